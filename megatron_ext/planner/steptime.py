"""Predicted step time: each pipeline stage's kernels at the shapes the run computes
(``megatron_ext.planner.work``), timed by the device's kernel model (``megatron_ext.planner.profiles.Device``:
a measured profile where stored, else the datasheet model of ``megatron_ext.planner.hardware``), the
communication on the link models of ``megatron_ext.schedules.costmodel``, and the schedule.

Per micro-batch, on one rank of each stage, each component megatron places there (the embedding, its
decoder layers, the output layer and loss, MTP layers: ``memory.chunk_components``), forward and
backward:

- ``gemm``: every linear layer as three matrix products at its shape (forward [T, K] x [K, N], the
  input gradient, the weight gradient accumulated into the main gradient), T the micro-batch's tokens,
  N and K split by tensor parallelism; FP8 where the run's transformer-engine linears are;
- ``grouped_gemm``: the experts as grouped products, experts / EP groups of (tokens per rank x top-k
  / local experts) rows each (balanced routing), each expert's weights read once per pass: at a few
  hundred rows per expert the weight gradient's main-gradient traffic binds;
- ``attention``: the core attention the run will use (``work.attention_kind``): transformer-engine's fused
  or torch SDPA (flash-class: FLOPs of the causal or windowed pairs), or megatron's unfused attention
  (memory-bound on its s x s scores whatever the window);
- ``memory``: element-wise work at the HBM rate, bytes counted per op (norms, residual adds, RoPE,
  activation, the MoE permutation and the all-to-all dispatcher's re-sorting, FP8 casts, the
  embedding's gradient, the loss over the vocabulary), fused or not as the run's flags say;
- ``recompute``: the forward work that recompute re-runs (full: the layer; selective: the modules);
- ``moe_fixed``: per MoE layer, time that does not scale with the tokens (``hardware.MOE_LAYER_S``);
- ``tp``, ``ep``, ``cp``, ``pp``: tensor-parallel collectives (two per attention and MLP block per
  direction, NVLink), the expert all-to-alls (dispatch and combine, forward and backward: the share for
  ranks in this node over NVLink, the rest over InfiniBand), context parallelism's exchanges per comm
  type beyond what the attention hides (``context_parallel_s``), the pipeline's sends.

The step: m micro-batches at the pace of the slowest stage plus the pipeline's fill and drain,
(PP - 1) / VPP of the average stage's time per micro-batch (1F1B; with equal stages this is the
bubble (PP - 1) / (VPP x m) of the step); data parallelism's gradient reduce-scatter and parameter
all-gather beyond the compute they overlap (``dp_exposed``); and the offload copies the compute does
not hide (``offload_exposed``): a copied layer's group goes to the host while the next layer's forward
runs and must be there when that forward ends (the engine releases in stream order one hook behind),
and comes back while the backward of the layer after it runs (prefetch); the copy time beyond the
compute it overlaps stalls the compute stream. The last layer of a pass whose backward follows at once
(every pass of the last stage) is never copied. The same function predicts gpu_check's offload
overhead from the compute measured there (scripts/gpu_check_sections/offload.py).
"""
from __future__ import annotations

from megatron_ext.attention import comm_types
from megatron_ext.planner.work import component_work, recompute_s, shapes
from megatron_ext.schedules.costmodel import INFINIBAND, NVLINK, bus_factor

GPUS_PER_NODE = 8
TERMS = ("gemm_s", "grouped_gemm_s", "attention_s", "memory_s", "recompute_s", "moe_fixed_s", "tp_s", "ep_s",
         "cp_s", "pp_s", "bubble_s", "dp_exposed_s", "offload_exposed_s")


def _coll(link, op: str, n: int, nbytes: float, count: float) -> float:
    if n <= 1 or count <= 0:
        return 0.0
    return count * (link.latency + bus_factor(op, n) * nbytes / link.bus_bandwidth)


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


def context_parallel_s(args, layout, comm_type: str, attention_s: float) -> float:
    """Seconds per micro-batch of one attention layer's context-parallel communication, forward and
    backward, beyond the attention compute that hides it (``attention_s``: the layer's core attention,
    both directions), per megatron_ext.attention.context_parallel: ``all_gather`` gathers the keys and
    values and reduce-scatters their gradients, ``a2a`` runs four all-to-alls each way (queries, keys,
    values, output: key / value groups repeated to CP when fewer), neither overlapped with the kernel;
    ``p2p`` passes key / value blocks (values padded to the key head size) CP - 1 steps around the
    ring, their fp32 gradients too in backward, each step's transfer under that step's block (the
    attention / CP): only what a step's transfer takes beyond its block is exposed. On NVLink while
    TP x CP fits a node, else InfiniBand."""
    from megatron_ext.planner.run import local_seq
    from megatron_ext.planner.work import attention_dims

    cp = layout.cp
    if cp <= 1:
        return 0.0
    link = NVLINK if layout.tp * cp <= GPUS_PER_NODE else INFINIBAND
    heads, groups, qk, dv = attention_dims(args, layout.tp)
    elem = 2 if (args.bf16 or args.fp16) else 4
    tokens = local_seq(args) * args.micro_batch_size
    if comm_type == "all_gather":
        kv = cp * tokens * groups * (qk + dv) * elem  # the gathered keys and values
        return _coll(link, "all_gather", cp, kv, 1) + _coll(link, "reduce_scatter", cp, kv, 1)
    if comm_type == "a2a":
        per_way = tokens * (heads * (qk + dv) + max(groups, cp) * (qk + dv)) * elem
        return 2 * _coll(link, "all_to_all", cp, per_way, 1)
    block = tokens * groups * qk * elem
    step = 2 * (link.latency + 2 * block / link.bus_bandwidth) + 2 * block * 4 / elem / link.bus_bandwidth
    return (cp - 1) * max(0.0, step - attention_s / cp)


def _dispatch_s(args, layout, tokens: int, count: float) -> float:
    """``count`` expert exchanges (dispatch or combine, each way) of ``tokens`` tokens per rank. The
    all-to-all dispatchers send each of a token's top-k rows to its expert's rank: the share for ranks
    in this node over NVLink, the rest over InfiniBand (``_all_to_all``). The flex dispatcher
    (DeepEP / HybridEP) sends a token once to each other node holding one of its experts and forwards
    it inside that node over NVLink: over InfiniBand, the expected number of distinct other nodes among
    its top-k (the router's group limit bounding the nodes it can reach); over NVLink, its rows."""
    topk, h = args.moe_router_topk or 1, args.hidden_size
    elem = 2 if (args.bf16 or args.fp16) else 4
    ep, etp = layout.ep, layout.etp
    if ep <= 1 or count <= 0:
        return 0.0
    if args.moe_token_dispatcher_type != "flex":
        return _all_to_all(ep, etp, tokens * topk * h * elem, count)
    local = max(1, min(ep, GPUS_PER_NODE // max(1, etp)))
    nodes = ep // local
    reach = nodes
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if groups and group_topk:  # experts of a group lie on groups / nodes consecutive nodes (or share one)
        reach = min(nodes, group_topk * max(1, nodes // groups))
    distinct = reach * (1 - (1 - 1 / reach) ** topk)
    ib = tokens * distinct * (nodes - 1) / nodes * h * elem / INFINIBAND.bus_bandwidth
    nvlink = tokens * topk * (local - 1) / local * h * elem / NVLINK.bus_bandwidth
    return count * ((INFINIBAND if nodes > 1 else NVLINK).latency + max(ib, nvlink))


def model_flops(args) -> float:
    import contextlib
    import io

    from megatron.training.training import num_floating_point_operations

    with contextlib.redirect_stdout(io.StringIO()):
        return float(num_floating_point_operations(args, args.global_batch_size))


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


def stage_times(args, layout, dev, recompute="none", attention: str | None = None) -> list:
    """Per pipeline stage: seconds per micro-batch by term (forward, backward, recompute and the
    stage's own communication), its MoE layers, and its layers' mean forward."""
    from megatron_ext.planner import memory
    from megatron_ext.planner.run import resolved_recompute, target_config

    sh = shapes(args, layout, attention)
    config = target_config(args)
    rec = resolved_recompute(args, recompute)
    cache: dict = {}
    topk = args.moe_router_topk or 0
    h = args.hidden_size
    act = sh.tokens * h * sh.elem
    out = []
    for p in range(layout.pp):
        terms = dict.fromkeys(("gemm_s", "grouped_gemm_s", "attention_s", "memory_s", "recompute_s", "moe_fixed_s",
                               "tp_s", "ep_s", "cp_s", "pp_s"), 0.0)
        fwd_layers, moe_layers = [], 0
        for v in range(layout.vpp or 1):
            for comp in memory.chunk_components(args, config, layout, p, v):
                if comp not in cache:
                    cache[comp] = component_work(args, sh, dev, comp)
                work = cache[comp]
                for k, s in work.total().items():
                    terms[k] += s
                terms["recompute_s"] += recompute_s(work, comp, rec)
                if isinstance(comp, tuple):
                    fwd_layers.append(work.forward_s())
                    moe = comp[1] == "moe"
                    mlp_collectives = 0 if (moe and sh.etp == 1 and not args.moe_shared_expert_intermediate_size) else 2
                    collectives = 2 + mlp_collectives + (2 if rec[0] == "full" else 0)
                    terms["tp_s"] += _coll(NVLINK, "all_reduce", layout.tp, act, collectives)
                    if layout.cp > 1:  # the layers' comm types, in the mean
                        types = comm_types(args)
                        terms["cp_s"] += sum(context_parallel_s(args, layout, c, work.total().get("attention_s", 0.0))
                                             for c in types) / len(types)
                    if moe and topk:
                        ep = _dispatch_s(args, layout, sh.moe_tokens, 4)
                        if args.overlap_moe_expert_parallel_comm:
                            # megatron's combined 1F1B: one micro-batch's exchanges run under another's
                            # compute of the same layer; what exceeds it stays exposed
                            ep = max(0.0, ep - sum(work.total().values()))
                        terms["ep_s"] += ep
                        terms["moe_fixed_s"] += dev.moe_layer_s
                        moe_layers += 1
                elif comp == "head":
                    terms["tp_s"] += _coll(NVLINK, "all_reduce", layout.tp, act, 1)
            if layout.pp > 1:
                pp_link = NVLINK if layout.tp * layout.pp <= GPUS_PER_NODE else INFINIBAND
                terms["pp_s"] += 2 * (pp_link.latency + act / layout.tp / pp_link.bus_bandwidth)
        out.append(dict(terms=terms, total_s=sum(terms.values()), moe_layers=moe_layers,
                        layer_forward_s=sum(fwd_layers) / len(fwd_layers) if fwd_layers else 0.0))
    return out


def bubble_s(layout, stage_seconds: list) -> float:
    """The pipeline's fill and drain: (pp - 1) / vpp of a mean stage's time per micro-batch (the slowest
    stage's m micro-batches are the rest of a step)."""
    return (layout.pp - 1) / (layout.vpp or 1) * sum(stage_seconds) / len(stage_seconds)


def step_time(args, layout, stage_preds: list, offload_bytes_per_layer: list, dev, host_link: float,
              recompute="none", attention: str | None = None) -> dict:
    """Seconds per step by term (each ``*_s`` key is added into ``step_time_s``). ``dev``: the GPU's
    kernel model (``profiles.device``); ``stage_preds``: the memory model's stages (their parameter
    bytes size the data-parallel collectives); ``offload_bytes_per_layer``: per stage, the bytes one
    layer's offloaded group copies (per micro-batch); ``recompute``: "none" / "full" / "selective"
    (core attention), or (granularity, modules); ``attention``: a core attention kind in place of the
    run's (``work.attention_kind``)."""
    sh = shapes(args, layout, attention)
    stages = stage_times(args, layout, dev, recompute, sh.attention)
    m = layout.microbatches
    slowest = max(range(len(stages)), key=lambda i: stages[i]["total_s"])
    terms = {k: m * v for k, v in stages[slowest]["terms"].items()}
    terms["bubble_s"] = bubble_s(layout, [s["total_s"] for s in stages])
    compute = m * stages[slowest]["total_s"]
    elem, grad_elem = sh.elem, sh.grad_elem
    param_bytes = max(p["components"]["parameters"] for p in stage_preds)
    dp_link = NVLINK if layout.tp * layout.pp * layout.dp <= GPUS_PER_NODE else INFINIBAND
    dp = _coll(dp_link, "reduce_scatter", layout.dp, param_bytes / elem * grad_elem, 1)
    if args.use_distributed_optimizer:
        dp += _coll(dp_link, "all_gather", layout.dp, param_bytes, 1)
    if args.overlap_grad_reduce:
        dp = max(0.0, dp - compute)
    terms["dp_exposed_s"] = dp
    layers = args.num_layers / layout.pp
    offload = 0.0
    for stage, group in enumerate(offload_bytes_per_layer):
        fwd = stages[min(stage, len(stages) - 1)]["layer_forward_s"]
        copies = copied_groups(layers, m, stage == len(offload_bytes_per_layer) - 1)
        offload = max(offload, offload_exposed(group, copies, host_link, fwd, 2 * fwd,
                                               dev.host_link_h2d if host_link == dev.host_link else None)["exposed_s"])
    terms["offload_exposed_s"] = offload
    terms = {k: terms[k] for k in TERMS}
    total = sum(terms.values())
    base = model_flops(args)
    tokens = args.global_batch_size * args.seq_length
    return dict(terms, step_time_s=total, layer_forward=stages[slowest]["layer_forward_s"], model_flops=base,
                slowest_stage=slowest, stage_seconds=[s["total_s"] for s in stages],
                tokens_per_s_per_gpu=tokens / total / layout.world,
                model_tflops_per_gpu=base / total / layout.world / 1e12,
                attention=sh.attention, kernels=dev.describe())
