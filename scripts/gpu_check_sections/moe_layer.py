"""moe_layer: one MoELayer (EP=1) with megatron's and the sync-free dispatcher, in bf16 (what training
runs): syncs, CUDA-graph capture and replay, agreement with megatron, step time.

* ``rows``: every dispatcher x mode, megatron's and ours, bf16: the detector's syncs, CUDA's
  (``set_sync_debug_mode``), whether the claimed sync-free modes run with every sync raising, the step
  time, agreement with megatron's layer of the same mode (zero-sync: megatron's dropless).
* ``zero_sync``: per layer size and dispatcher, the zero-sync dropless layer against megatron's dropless:
  forward and forward+backward captured in a CUDA graph and replayed on another routing, compared with
  eager; step times interleaved (median and spread); the difference to megatron's outputs and gradients
  (bf16: torch's CUTLASS grouped GEMM, not cuBLAS per expert, so compared to bf16 rounding).
* ``fp32``: the zero-sync layer in fp32, which ``--moe-zero-sync-dropless`` refuses on CUDA: the syncs
  that are the reason (torch's grouped-GEMM fallback) and the refusal line; bitwise to megatron's dropless
  there (the fallback runs megatron's per-expert products).

Every comparison, with megatron and of a replay with eager, runs under
``torch.use_deterministic_algorithms(True)`` (megatron's ``--deterministic-mode``): megatron's own
dropless layer differs between identical runs on CUDA without it (its unpermute's ``scatter_add_``);
that spread, with default algorithms, is measured too (``megatron_spread``). Syncs and times are measured
with default algorithms."""
from __future__ import annotations

import argparse
import contextlib
import os

import torch

from gpu_check_sections.common import (NO_CUDA, claim, count_cuda_syncs, cuda, interleaved_ms, sync_free,
                                       timed_ms)

COMPARISON = ("under torch.use_deterministic_algorithms(True) (megatron's --deterministic-mode); megatron's own "
              "dropless layer run twice with default algorithms differs by megatron_spread")
BF16_TOLERANCE = 2 ** -5  # max |ours - megatron| / max |megatron|, per tensor, zero-sync in bf16 (other kernels)


@contextlib.contextmanager
def deterministic():
    """torch.use_deterministic_algorithms(True), as megatron's --deterministic-mode sets it (with the
    cuBLAS workspace it needs, megatron/training/determinism.py), then the previous setting."""
    before = torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _step_tensors(layer, x, g, backward: bool) -> list:
    """[output] or [output, input grad, weight grads...] of one pass (autograd.grad: nothing accumulates)."""
    out = layer(x)[0]
    if not backward:
        return [out]
    params = [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out, [x, *params], g, allow_unused=True)
    return [out, *[t for t in grads if t is not None]]


def graph_replays(layer, x, x_other, g, backward: bool) -> bool | str:
    """Capture ``layer``'s forward (and, with ``backward``, its input and weight gradients) in a CUDA
    graph, replay it on ``x_other`` (another routing) copied into the captured input, and compare every
    tensor with an eager pass on ``x_other``, bit for bit (deterministic algorithms)."""
    if not cuda():
        return NO_CUDA
    grad_mode = contextlib.nullcontext() if backward else torch.no_grad()
    try:
        with deterministic(), grad_mode:
            static_x = x.detach().clone().requires_grad_(backward)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the capture (allocator, lazy state)
                    _step_tensors(layer, static_x, g, backward)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _step_tensors(layer, static_x, g, backward)
            with torch.no_grad():
                static_x.copy_(x_other)
            graph.replay()
            torch.cuda.synchronize()
            replayed = [t.detach().clone() for t in captured]
            eager = _step_tensors(layer, x_other.detach().clone().requires_grad_(backward), g, backward)
            return len(replayed) == len(eager) and all(torch.equal(a, b) for a, b in zip(replayed, eager))
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _diff(ref, got) -> dict:
    """max |got - ref| over output, input grad and every weight grad, absolute and relative to max |ref|."""
    pairs = [(ref.out, got.out), (ref.dx, got.dx)] + [(ref.dw[k], got.dw[k]) for k in ref.dw]
    diffs = [((a.float() - b.float()).abs().max().item(), a.float().abs().max().item()) for a, b in pairs]
    return {"bitwise": all(torch.equal(a, b) for a, b in pairs) and sorted(ref.dw) == sorted(got.dw),
            "max_abs": max(d for d, _ in diffs), "max_rel_to_max": max(d / max(m, 1e-30) for d, m in diffs)}


def grouped_gemm_refusal(bf16: bool) -> str | None:
    """The refusal --moe-zero-sync-dropless gets on this GPU (on CPU: on a declared CUDA target) in this
    precision, before any compute; None where it is accepted."""
    from megatron_ext import moe
    from megatron_ext.errors import ConfigError

    args = argparse.Namespace(bf16=bf16, fp16=False, platform=None if cuda() else "cuda", dry_run=not cuda(),
                              assume_te=None, assume_apex=False, target_gpu=None)
    try:
        moe.check_grouped_gemm_platform(args, f"{moe.ZERO_SYNC}=True")
    except ConfigError as e:
        return str(e)
    return None


def _measure(layer, x, g, ours: bool, mode: str, reps: int) -> tuple:
    """(row fields, LayerRun under deterministic algorithms) of one layer."""
    from megatron_ext.moe import audit
    from megatron_ext.moe.sync_detector import run_backward

    with deterministic():
        run = audit.run_layer(layer, x, g)

    def forward():
        return layer(x.clone().requires_grad_(True))[0]

    def step():
        run_backward(forward(), g)

    syncs_fwd, out = count_cuda_syncs(forward)
    syncs_bwd, _ = count_cuda_syncs(lambda: run_backward(out, g))
    del out
    claimed = ours and mode != "dropless"  # the paths claimed to run with no sync
    fields = {"syncs_forward": run.syncs_forward, "syncs_backward": run.syncs_backward,
              "cuda_syncs_forward": syncs_fwd, "cuda_syncs_backward": syncs_bwd,
              "cuda_sync_free_step": sync_free(step) if claimed else "-", "step_ms": timed_ms(step, reps)}
    return fields, run, step


def section_moe_layer(size, claims) -> dict:
    from megatron_ext import seams
    from megatron_ext.moe import audit
    from megatron_ext.training import parallel

    rows, zero_sync, fp32, spread = [], [], [], {}
    reps = size["layer_reps"]
    parallel.initialize()
    try:
        for layer_cfg in size["layers"]:
            shape = dict(experts=layer_cfg["experts"], topk=layer_cfg["topk"], hidden=layer_cfg["hidden"],
                         ffn=layer_cfg["ffn"])
            name = f"{layer_cfg['name']}, bf16"
            for dispatcher in audit.DISPATCHERS:
                refs, megatron_step = {}, None
                for ours in (False, True):
                    for mode in audit.MODES:
                        if not ours and mode == "dropless-syncfree":
                            continue  # its reference is megatron's dropless layer
                        spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, dtype="bfloat16", **shape)
                        x, g = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=1)
                        seams.reset_moe_aux_loss_scale()
                        layer = audit.build_layer(spec, seed=1, ours=ours)
                        fields, run, step = _measure(layer, x, g, ours, mode, reps)
                        row = {"layer": name, "tokens": layer_cfg["seq"] * 2,
                               "dispatcher": ("multihot-" if ours else "megatron-") + dispatcher, "mode": mode, **fields}
                        if not ours:
                            refs[mode] = run
                            if mode == "dropless":  # also the reference row of the zero-sync mode
                                megatron_step = step  # holds megatron's layer until the zero-sync row is done
                                rows.append(dict(row, mode="dropless-syncfree"))
                                if dispatcher == "alltoall":  # megatron against itself, default algorithms
                                    again = audit.run_layer(layer, x, g)
                                    spread[name] = _diff(audit.run_layer(layer, x, g), again)["max_abs"]
                        else:
                            diff = _diff(refs["dropless" if mode == "dropless-syncfree" else mode], run)
                            row.update(bitwise_equal_to_megatron=diff["bitwise"], max_abs_diff_to_megatron=diff["max_abs"])
                            if mode == "dropless-syncfree":
                                x_other, _ = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=2)
                                ms_ours, ms_megatron = interleaved_ms([step, megatron_step], 2 * reps)
                                zero_sync.append({
                                    "layer": name, "dispatcher": dispatcher,
                                    "graph_forward_replay_equal": graph_replays(layer, x, x_other, g, backward=False),
                                    "graph_step_replay_equal": graph_replays(layer, x, x_other, g, backward=True),
                                    "step_ms": ms_ours, "megatron_dropless_step_ms": ms_megatron,
                                    "max_rel_diff_to_megatron": diff["max_rel_to_max"], "bitwise_to_megatron": diff["bitwise"],
                                })
                        rows.append(row)
                        del layer
            # fp32: what the CUDA refusal is about, and the bitwise claim where the products are megatron's
            runs = {}
            for ours in (False, True):
                spec = audit.LayerSpec(dispatcher="alltoall", mode="dropless-syncfree" if ours else "dropless",
                                       dtype="float32", **shape)
                x, g = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=1)
                seams.reset_moe_aux_loss_scale()
                layer = audit.build_layer(spec, seed=1, ours=ours)
                fields, runs[ours], _ = _measure(layer, x, g, ours, spec.mode, 1)
                del layer
            diff = _diff(runs[False], runs[True])
            fp32.append({"layer": f"{layer_cfg['name']}, fp32", "dispatcher": "alltoall",
                         "syncs_forward": fields["syncs_forward"], "syncs_backward": fields["syncs_backward"],
                         "cuda_syncs_forward": fields["cuda_syncs_forward"],
                         "cuda_syncs_backward": fields["cuda_syncs_backward"],
                         "bitwise_equal_to_megatron": diff["bitwise"], "max_abs_diff_to_megatron": diff["max_abs"]})
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()
    refused, accepted_bf16 = grouped_gemm_refusal(bf16=False), grouped_gemm_refusal(bf16=True)
    ours = [r for r in rows if r["dispatcher"].startswith("multihot")]
    claimed = [r for r in ours if r["mode"] != "dropless"]
    claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes (bf16): zero syncs forward and backward "
          "(detector)", all(r["syncs_forward"] == 0 and r["syncs_backward"] == 0 for r in claimed))
    claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes (bf16): zero syncs under "
          "set_sync_debug_mode('error')",
          all(r["cuda_sync_free_step"] is True and r["cuda_syncs_forward"] == r["cuda_syncs_backward"] == 0
              for r in claimed) if cuda() else NO_CUDA)
    claim(claims, "sync-free dispatcher, dropless: one sync per layer forward (the split sizes)",
          all(r["syncs_forward"] + r["syncs_backward"] == 1 for r in ours if r["mode"] == "dropless"))
    claim(claims, "zero-sync dropless MoE layer (bf16): forward captured in a CUDA graph, replayed on another routing, "
          "equal to eager", all(z["graph_forward_replay_equal"] is True for z in zero_sync) if cuda() else NO_CUDA)
    claim(claims, "zero-sync dropless MoE layer (bf16): forward+backward captured in a CUDA graph, replayed on another "
          "routing, output and input/weight gradients equal to eager",
          all(z["graph_step_replay_equal"] is True for z in zero_sync) if cuda() else NO_CUDA)
    claim(claims, "zero-sync dropless MoE layer (bf16): step no slower than megatron's dropless (medians, interleaved), "
          "at every layer size and dispatcher",
          all(z["step_ms"]["median"] <= z["megatron_dropless_step_ms"]["median"] for z in zero_sync)
          if cuda() else NO_CUDA)
    claim(claims, "--moe-zero-sync-dropless in fp32 on CUDA: refused by name before any compute (torch's grouped-GEMM "
          "fallback syncs: see fp32); accepted in bf16 here",
          refused is not None and refused.startswith("--moe-zero-sync-dropless=True with fp32") and accepted_bf16 is None)
    claim(claims, "sync-free dispatcher bit-identical to megatron's (dropless, capacity; zero-sync dropless in fp32, whose "
          "grouped GEMM runs megatron's per-expert products), compared under deterministic algorithms",
          all(r["bitwise_equal_to_megatron"] for r in ours if r["mode"] in ("dropless", "capacity"))
          and all(r["bitwise_equal_to_megatron"] for r in fp32))
    claim(claims, f"zero-sync dropless MoE layer (bf16) equal to megatron's dropless to bf16 rounding (largest difference <= "
          f"{BF16_TOLERANCE} x the largest magnitude, per tensor; other GEMM kernels), under deterministic algorithms",
          all(z["max_rel_diff_to_megatron"] <= BF16_TOLERANCE for z in zero_sync))
    return {"status": "ok", "comparison": COMPARISON, "megatron_spread": spread, "rows": rows, "zero_sync": zero_sync,
            "fp32": fp32, "fp32_refusal": refused, "bf16_refusal": accepted_bf16}
