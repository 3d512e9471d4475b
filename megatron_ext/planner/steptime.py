"""Predicted step time of one rank: compute from FLOPs, communication on the link models of
``megatron_ext.schedules.costmodel``, and the host-link time of offload that compute does not hide.

- gemm: megatron's model FLOPs of the global batch (``megatron.training.training.
  num_floating_point_operations``, the formula of its model TFLOP/s) / world size / (the GEMMs' peak,
  FP8 with --fp8-format, x efficiency); recompute: one forward of what it re-runs (full: a third of
  the step; selective: the attention-score part, s / (s + 6h) of it); bubble: (gemm + recompute) x
  (PP - 1) / (VPP x micro-batches);
- moe_memory: per MoE layer and micro-batch, the memory-bound work around the expert GEMMs
  (permutation, gating, activation and their gradients): routed rows x hidden x a calibrated bytes
  factor / HBM bandwidth, plus a calibrated fixed time per MoE layer and micro-batch (the router,
  the dispatcher's host-side steps and the many small kernels a MoE layer launches);
- tensor parallel: per layer and micro-batch, two all-reduce-sized collectives forward and two backward
  of the layer's activations (all-gather + reduce-scatter under sequence parallelism carry the same
  bus bytes), on NVLink inside a node;
- expert parallel: per MoE layer and micro-batch, dispatch and combine all-to-alls forward and
  backward of top-k routed tokens: the share for ranks in this node over NVLink, the rest over
  InfiniBand, concurrently;
- data parallel: gradient reduce-scatter (or all-reduce) and, with the distributed optimizer, the
  parameter all-gather; overlapped with backward when --overlap-grad-reduce (only what exceeds the
  compute is exposed);
- pipeline: one send forward and one backward per micro-batch per model chunk;
- offload (``offload_exposed``): a copied layer's group goes to the host while the next layer's
  forward runs and must be there when that forward ends (the engine releases in stream order one hook
  behind), and comes back while the backward of the layer after it runs (prefetch); the copy time
  beyond the compute it overlaps stalls the compute stream. The last layer of a pass whose backward
  follows at once (every pass of the last stage) is never copied. So the host link bounds what can be
  offloaded per forward without slowing the step. The same function predicts gpu_check's offload
  overhead from the compute measured there (scripts/gpu_check_sections/offload.py).
"""
from __future__ import annotations

from megatron_ext.planner.run import layer_kinds
from megatron_ext.schedules.costmodel import INFINIBAND, NVLINK, _factor

GPUS_PER_NODE = 8


def _coll(link, op: str, n: int, nbytes: float, count: float) -> float:
    if n <= 1 or count <= 0:
        return 0.0
    return count * (link.latency + _factor(op, n) * nbytes / link.bus_bandwidth)


def _all_to_all(ep: int, etp: int, nbytes: float, count: float) -> float:
    """``count`` all-to-alls of ``nbytes`` per rank over an expert-parallel group of ``ep`` ranks laid
    out consecutively (expert TP inside): the share bound for ranks in this node goes over NVLink,
    the rest over InfiniBand, at the same time; the slower share is the time."""
    if ep <= 1 or count <= 0:
        return 0.0
    local = max(1, min(ep, GPUS_PER_NODE // max(1, etp)))  # group members in this node, self included
    nvlink = (local - 1) / ep * nbytes / NVLINK.bus_bandwidth
    ib = (ep - local) / ep * nbytes / INFINIBAND.bus_bandwidth
    return count * ((INFINIBAND if ep > local else NVLINK).latency + max(nvlink, ib))


def model_flops(args) -> float:
    import contextlib
    import io

    from megatron.training.training import num_floating_point_operations

    with contextlib.redirect_stdout(io.StringIO()):
        return float(num_floating_point_operations(args, args.global_batch_size))


def peak_flops(args, gpu: dict) -> float:
    """The GEMMs' peak: FP8 where --fp8-format asks for it (transformer-engine), else BF16."""
    return gpu["peak_fp8_flops"] if getattr(args, "fp8", None) else gpu["peak_flops"]


def offload_exposed(copy_bytes: float, copies: float, link: float, layer_forward_s: float,
                    layer_backward_s: float, link_h2d: float | None = None) -> dict:
    """Host-link seconds per step that compute does not hide, for ``copies`` layer groups of
    ``copy_bytes`` each, on a link of ``link`` bytes/s device to host (``link_h2d`` back; the same if
    not given): per copy, the D2H beyond the next layer's forward and the H2D beyond the backward it
    overlaps."""
    d2h_copy = copy_bytes / link if copy_bytes else 0.0
    h2d_copy = copy_bytes / (link_h2d or link) if copy_bytes else 0.0
    d2h = copies * max(0.0, d2h_copy - layer_forward_s)
    h2d = copies * max(0.0, h2d_copy - layer_backward_s)
    return dict(copy_s=d2h_copy, d2h_s=d2h, h2d_s=h2d, exposed_s=d2h + h2d)


def copied_groups(layers: float, passes: float, last_stage: bool) -> float:
    """Layer groups a stage copies per step: every layer of every pass, but the last layer of each pass
    whose backward follows its forward at once (PP=1 and the last stage: never copied)."""
    return max(0.0, (layers - 1) * passes) if last_stage else layers * passes


def step_time(args, layout, stage_preds: list, offload_bytes_per_layer: list, gpu: dict, efficiency: float,
              host_link: float, recompute: str) -> dict:
    """Seconds per step of the slowest part, by term (each ``*_s`` key is added into ``step_time_s``).
    ``offload_bytes_per_layer``: per stage, the bytes one layer's offloaded group copies (per
    micro-batch)."""
    from megatron_ext.planner.hardware import MOE_BYTES_PER_ROW_ELEMENT, MOE_LAYER_S

    elem = 2 if (args.bf16 or args.fp16) else 4
    rate = peak_flops(args, gpu) * efficiency
    base = model_flops(args)
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    extra = {"full": 1 / 3, "selective": (s / (s + 6 * h)) / 3}.get(recompute, 0.0)
    vpp = layout.vpp or 1
    m = layout.microbatches
    gemm = base / layout.world / rate
    bubble = gemm * (1 + extra) * (layout.pp - 1) / (vpp * m)
    layers = args.num_layers / layout.pp
    moe_layers = layers * (sum(1 for k in layer_kinds(args) if k == "moe") / max(1, args.num_layers))
    act = s * b * h * elem
    tp = _coll(NVLINK, "all_reduce", layout.tp, act, 4 * layers * m)
    topk = getattr(args, "moe_router_topk", 0) or 0
    rows = s * b / layout.tp * topk  # routed rows per rank and MoE layer
    ep = _all_to_all(layout.ep, layout.etp, rows * h * elem, 4 * moe_layers * m)
    moe = moe_layers * m * (rows * h * MOE_BYTES_PER_ROW_ELEMENT / gpu["hbm"] + MOE_LAYER_S) if topk else 0.0
    param_bytes = max(p["components"]["parameters"] for p in stage_preds)
    dp_link = NVLINK if layout.tp * layout.pp * layout.dp <= GPUS_PER_NODE else INFINIBAND
    grad_elem = 4 if getattr(args, "accumulate_allreduce_grads_in_fp32", False) else elem
    dp = _coll(dp_link, "reduce_scatter", layout.dp, param_bytes / elem * grad_elem, 1)
    if getattr(args, "use_distributed_optimizer", False):
        dp += _coll(dp_link, "all_gather", layout.dp, param_bytes, 1)
    if getattr(args, "overlap_grad_reduce", False):
        dp = max(0.0, dp - gemm)
    pp_link = NVLINK if layout.tp * layout.pp <= GPUS_PER_NODE else INFINIBAND
    pp = 2 * vpp * m * (pp_link.latency + act / layout.tp / pp_link.bus_bandwidth) if layout.pp > 1 else 0.0
    # one layer's forward on this rank, per micro-batch (model FLOPs are 3 forwards)
    layer_fwd = base / 3 / (layout.dp * m) / max(1, args.num_layers) / layout.tp / rate
    offload = 0.0
    for stage, group in enumerate(offload_bytes_per_layer):
        copies = copied_groups(layers, m, stage == len(offload_bytes_per_layer) - 1)
        offload = max(offload, offload_exposed(group, copies, host_link, layer_fwd, 2 * layer_fwd)["exposed_s"])
    terms = dict(gemm_s=gemm, recompute_s=gemm * extra, bubble_s=bubble, moe_memory_s=moe, tp_s=tp, ep_s=ep,
                 dp_exposed_s=dp, pp_s=pp, offload_exposed_s=offload)
    total = sum(terms.values())
    tokens = args.global_batch_size * s
    return dict(terms, step_time_s=total, layer_forward=layer_fwd, model_flops=base,
                tokens_per_s_per_gpu=tokens / total / layout.world,
                model_tflops_per_gpu=base / total / layout.world / 1e12)
