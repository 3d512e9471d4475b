"""Every claim this project makes about one GPU, checked and measured by one command.

    python3 scripts/gpu_check.py [--out docs/gpu] [--sections cuda_facts,multihot,...] [--budget-s 1080]
    python3 scripts/gpu_check.py --cpu-smoke [--out DIR]      # the same code paths, tiny sizes, on CPU

Writes ``<out>/<date>-<device>.json`` (rewritten after every section, so an interrupted run keeps what
it measured) and ``<out>/<date>-<device>.md``, the markdown tables it also prints. Sections:

cuda_facts          what the CPU platform simulates, checked on the device: backward nodes of CUDA
                    tensors run on a thread other than the caller's (threading.local is not carried);
                    an event recorded after a D2H copy is not complete right after the host enqueues it
multihot            indices_to_multihot vs megatron-core's _indices_to_multihot, tokens up to 131072 x
                    experts up to 256: zero syncs under torch.cuda.set_sync_debug_mode("error"), the
                    reference's syncs counted by the same mode ("warn"), bit-identity at every shape,
                    time vs the reference (scripts/bench_dispatcher.py's bench_multihot)
moe_layer           one MoELayer, EP=1, megatron's and the sync-free dispatcher, alltoall/allgather x
                    dropless/capacity/capacity-nopad: syncs forward/backward (SyncDetector, and
                    set_sync_debug_mode("error") for the sync-free claims), agreement, time
offload             PP=1, bf16, hidden 4096, seq 4096, every module set: peak memory
                    (torch.cuda.max_memory_allocated) off vs on, saved / theoretical = R, step time
                    (CUDA events) and its overhead, bytes offloaded per step, the host-link bandwidth
                    (pinned copies), gradients bit-identical
train               train.py end to end, a few iterations: the dense recipe with activation offload
                    and the MoE recipe with the sync-free dispatcher (the platform defaults of a GPU
                    without apex/transformer-engine, for real)
planner             the planner's predicted peak bytes (scripts/plan.py's model) against one measured
                    training step (megatron_ext.bench.plan.measure: torch.cuda.max_memory_allocated on a
                    GPU, live tensor bytes on CPU), dense and MoE, PP=1, with and without offload
transformer_engine  the transformer-engine spec builds, trains a few steps with offload hooks that
                    capture bytes; or why not (not importable)

``--cpu-smoke`` runs every section at tiny sizes on CPU, so this script cannot rot: what only a GPU
can measure reads "skipped: no CUDA". Exit code 0 when every section ran and every claim held.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform as pyplatform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

NO_CUDA = "skipped: no CUDA"
SCHEMA = 1
SECTIONS = ("cuda_facts", "multihot", "moe_layer", "offload", "train", "planner", "transformer_engine")

# Sizes: "gpu" is what one H100/H200 measures within the budget; "smoke" exercises the same code.
SIZES = {
    "gpu": dict(
        multihot_tokens=(4096, 16384, 65536, 131072), multihot_experts=(8, 64, 256), multihot_reps=20,
        layers=[dict(name="8 experts top-2, h4096 ffn4096", experts=8, topk=2, hidden=4096, ffn=4096, seq=4096),
                dict(name="64 experts top-8, h2048", experts=64, topk=8, hidden=2048, ffn=1024, seq=4096)],
        layer_reps=5,
        offload=dict(dense=dict(model="dense", layers=8, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                                ffn=16384, microbatches=1),
                     moe=dict(model="moe", layers=4, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                              ffn=16384, experts=8, topk=2, moe_ffn=4096, shared=4096, microbatches=1)),
        offload_warmup=2, offload_steps=4, copy_bytes=256 << 20,
        train_extra=["--bf16"],
        plan_extra=["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
                    "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
                    "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16"],
    ),
    "smoke": dict(
        multihot_tokens=(64, 512), multihot_experts=(8,), multihot_reps=2,
        layers=[dict(name="4 experts top-2, h32", experts=4, topk=2, hidden=32, ffn=64, seq=16)],
        layer_reps=1,
        offload=dict(dense=dict(model="dense", layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                                microbatches=2),
                     moe=dict(model="moe", layers=2, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                              experts=4, topk=2, moe_ffn=64, shared=64, microbatches=2)),
        offload_warmup=1, offload_steps=1, copy_bytes=1 << 20,
        train_extra=[],
        plan_extra=[],
    ),
}
DENSE_SETS = [["core_attention"], ["qkv_linear"], ["attn_proj"], ["qkv_linear", "core_attention", "attn_proj"]]
MOE_SETS = [["router_fc1"], ["moe_act"], ["router_fc2"], ["shared_experts"],
            ["qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act", "router_fc2", "shared_experts"]]


# ------------------------------------------------------------------------------------------------ helpers
def cuda() -> bool:
    return torch.cuda.is_available()


def _sync():
    if cuda():
        torch.cuda.synchronize()


def timed_ms(fn, reps: int) -> float | str:
    """Median device time of fn (CUDA events), after one warm-up call."""
    if not cuda():
        return NO_CUDA
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


@contextlib.contextmanager
def _sync_watch(mode: str):
    """torch.cuda.set_sync_debug_mode(mode) over the block; the explicit waits (Event/Stream
    .synchronize, torch.cuda.synchronize: megatron's dropless alltoall waits on an event,
    token_dispatcher.py:950) are counted ("warn") or refused ("error") here, each exactly once,
    since torch's mode does not report every one of them."""
    explicit = []
    restore = []

    def watch(owner, name):
        original = getattr(owner, name)

        def waiting(*a, **k):
            if mode == "error":
                raise RuntimeError(f"called a synchronizing CUDA operation ({owner.__name__}.{name})")
            explicit.append(name)
            torch.cuda.set_sync_debug_mode("default")  # counted here, once, whether or not torch warns
            try:
                return original(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        setattr(owner, name, waiting)
        restore.append((owner, name, original))

    _sync()
    for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")):
        watch(owner, name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield lambda: len(explicit) + sum(1 for w in seen if "synchroniz" in str(w.message))
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for owner, name, original in reversed(restore):
                setattr(owner, name, original)


def count_cuda_syncs(fn):
    """(host-device synchronisations fn performs on CUDA, fn's result); (NO_CUDA, result) on CPU."""
    if not cuda():
        return NO_CUDA, fn()
    with _sync_watch("warn") as count:
        result = fn()
        return count(), result


def sync_free(fn) -> bool | str:
    """True if fn runs with every synchronisation raising (set_sync_debug_mode("error") and the
    explicit waits)."""
    if not cuda():
        return NO_CUDA
    try:
        with _sync_watch("error"):
            fn()
        return True
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return False


def device_name() -> str:
    return torch.cuda.get_device_name() if cuda() else "cpu"


def _version(dist: str):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def host_info() -> dict:
    from megatron_ext.platform import target

    info = {
        "python": pyplatform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "megatron_core": _version("megatron-core"), "transformer_engine": _version("transformer-engine"),
        "transformer_engine_importable": target.te_importable(), "apex_kernels_importable": target.apex_importable(),
        "cpu_count": os.cpu_count(),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }
    if cuda():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, compute_capability=f"{p.major}.{p.minor}", memory_bytes=p.total_memory,
                    multiprocessors=p.multi_processor_count)
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def _claim(claims: list, text: str, holds) -> None:
    """holds: True / False, or a "skipped: ..." string."""
    claims.append({"claim": text, "holds": holds})


# ------------------------------------------------------------------------------------------------ sections
def section_cuda_facts(size, claims) -> dict:
    """The CUDA behaviour the CPU platform's faithful mode imitates, observed on this device."""
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.platform import faithful, streams

    local = threading.local()
    local.lane = "caller"
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["thread"] = threading.get_ident()
            seen["local"] = getattr(local, "lane", None)
            return g * 2

    dev = "cuda" if cuda() else "cpu"
    x = torch.randn(1024, device=dev, requires_grad=True)
    run_backward(Probe.apply(x).sum())
    observed_thread = {
        "backward_on_other_thread": seen["thread"] != threading.get_ident(),
        "threading_local_seen_in_backward": seen["local"] == "caller",
    }

    n = size["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = streams.host_empty(n)
    side = streams.Stream()
    side.wait(streams.Stream.current())
    side.run(lambda: dst.copy_(src, non_blocking=True))
    event = side.record()
    done_at_enqueue = event.query()
    event.synchronize()
    observed_event = {"copy_bytes": n, "event_done_right_after_enqueue": done_at_enqueue,
                      "event_done_after_synchronize": event.query()}

    out = {"faithful_mode": faithful.enabled()}
    if cuda():
        out.update(status="ok", **observed_thread, **observed_event)
        _claim(claims, "CUDA backward nodes run on a thread other than the caller's", observed_thread["backward_on_other_thread"])
        _claim(claims, "threading.local values are not carried into CUDA backward", not observed_thread["threading_local_seen_in_backward"])
        _claim(claims, "an event after a D2H copy is not complete right after enqueue", not done_at_enqueue)
        _claim(claims, "the event completes once synchronized", observed_event["event_done_after_synchronize"])
    else:
        out.update(status="ok", backward_on_other_thread=NO_CUDA, threading_local_seen_in_backward=NO_CUDA,
                   event_done_right_after_enqueue=NO_CUDA, event_done_after_synchronize=NO_CUDA,
                   cpu_platform_observed={**observed_thread, **observed_event})
        for text in ("CUDA backward nodes run on a thread other than the caller's",
                     "an event after a D2H copy is not complete right after enqueue"):
            _claim(claims, text, NO_CUDA)
    return out


def section_multihot(size, claims) -> dict:
    from megatron_ext import platform
    from megatron_ext.moe.multihot import indices_to_multihot, reference_indices_to_multihot
    from scripts.bench_dispatcher import bench_multihot

    device = platform.current().device
    rows = []
    for experts in size["multihot_experts"]:
        topk = min(8, experts) if experts > 8 else 2
        for tokens in size["multihot_tokens"]:
            bench = bench_multihot(tokens, topk, experts, size["multihot_reps"])
            gen = torch.Generator().manual_seed(tokens * 7 + experts)
            idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
            idx = idx.masked_fill(torch.rand(tokens, topk, generator=gen) < 0.3, -1).to(device)
            probs = torch.rand(tokens, topk, generator=gen).to(device)
            ref_map, ref_probs = reference_indices_to_multihot(idx, probs, experts)
            our_map, our_probs = indices_to_multihot(idx, probs, experts, out_dtype=torch.float32)
            equal = torch.equal(ref_map, our_map) and torch.equal(ref_probs.view(torch.int32), our_probs.view(torch.int32))
            t_ref = timed_ms(lambda: reference_indices_to_multihot(idx, probs, experts), size["multihot_reps"])
            t_ours = timed_ms(lambda: indices_to_multihot(idx, probs, experts), size["multihot_reps"])
            rows.append({
                "tokens": tokens, "experts": experts, "topk": topk,
                "bitwise_equal_at_shape": bool(equal),
                "bitwise_equal_random_cases": bench["bitwise_equal"],
                "syncs_detector_reference": bench["syncs_reference"], "syncs_detector_ours": bench["syncs_ours"],
                "cuda_syncs_reference": count_cuda_syncs(lambda: reference_indices_to_multihot(idx, probs, experts))[0],
                "cuda_sync_free_ours": sync_free(lambda: indices_to_multihot(idx, probs, experts)),
                "time_reference_ms": t_ref, "time_ours_ms": t_ours,
                "time_ours_over_reference": round(t_ours / t_ref, 3) if cuda() else NO_CUDA,
            })
    _claim(claims, "indices_to_multihot is bit-identical to megatron-core's at every shape",
           all(r["bitwise_equal_at_shape"] and r["bitwise_equal_random_cases"] for r in rows))
    _claim(claims, "indices_to_multihot: zero syncs (detector)", all(r["syncs_detector_ours"] == 0 for r in rows))
    _claim(claims, "indices_to_multihot: zero syncs under set_sync_debug_mode('error')",
           all(r["cuda_sync_free_ours"] is True for r in rows) if cuda() else NO_CUDA)
    return {"status": "ok", "rows": rows}


def cuda_graph_replays(layer, x, x_other) -> bool | str:
    """Capture ``layer``'s forward (no grad) in a CUDA graph, replay it on another input (another
    routing) copied into the captured one, and compare with the eager output bit for bit."""
    if not cuda():
        return NO_CUDA
    try:
        with torch.no_grad():
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the capture (allocator, lazy state)
                    layer(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static_x)[0]
            static_x.copy_(x_other)
            graph.replay()
            torch.cuda.synchronize()
            return bool(torch.equal(static_out, layer(x_other)[0]))
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def section_moe_layer(size, claims) -> dict:
    from megatron_ext import seams
    from megatron_ext.moe import audit
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.training import parallel

    rows = []
    parallel.initialize()
    try:
        for layer_cfg in size["layers"]:
            for dispatcher in ("alltoall", "allgather"):
                for mode in audit.MODES:
                    spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, experts=layer_cfg["experts"],
                                           topk=layer_cfg["topk"], hidden=layer_cfg["hidden"], ffn=layer_cfg["ffn"])
                    x, g = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=1)
                    runs = {}
                    for ours in (False, True):
                        seams.reset_moe_aux_loss_scale()
                        layer = audit.build_layer(spec, seed=1, ours=ours)
                        runs[ours] = run = audit.run_layer(layer, x, g)

                        def forward(layer=layer):
                            return layer(x.clone().requires_grad_(True))[0]

                        def step(layer=layer):
                            run_backward(forward(), g)

                        syncs_fwd, out = count_cuda_syncs(forward)
                        syncs_bwd, _ = count_cuda_syncs(lambda out=out: run_backward(out, g))
                        del out
                        claimed = ours and mode != "dropless"  # the paths claimed to run with no sync
                        graph = "-"
                        if ours and mode in ("capacity", "dropless-syncfree"):
                            x_other, _ = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=2)
                            graph = cuda_graph_replays(layer, x, x_other)
                        rows.append({
                            "layer": layer_cfg["name"], "tokens": layer_cfg["seq"] * 2,
                            "dispatcher": ("multihot-" if ours else "megatron-") + dispatcher, "mode": mode,
                            "syncs_forward": run.syncs_forward, "syncs_backward": run.syncs_backward,
                            "cuda_syncs_forward": syncs_fwd, "cuda_syncs_backward": syncs_bwd,
                            "cuda_sync_free_step": sync_free(step) if claimed else "-",
                            "cuda_graph_replay_bitwise": graph,
                            "step_ms": timed_ms(step, size["layer_reps"]),
                        })
                        del layer
                    ref, got = runs[False], runs[True]
                    rows[-1]["bitwise_equal_to_megatron"] = bool(
                        torch.equal(ref.out, got.out) and torch.equal(ref.dx, got.dx)
                        and all(torch.equal(ref.dw[k], got.dw[k]) for k in ref.dw))
                    rows[-1]["max_abs_diff_to_megatron"] = max(
                        [(ref.out - got.out).abs().max().item(), (ref.dx - got.dx).abs().max().item()]
                        + [(ref.dw[k] - got.dw[k]).abs().max().item() for k in ref.dw])
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()
    ours = [r for r in rows if r["dispatcher"].startswith("multihot")]
    capacity = [r for r in ours if r["mode"] != "dropless"]
    _claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes: zero syncs forward and backward "
           "(detector)", all(r["syncs_forward"] == 0 and r["syncs_backward"] == 0 for r in capacity))
    _claim(claims, "zero-sync dropless MoE layer: captured in a CUDA graph, replayed on another routing, "
           "equal to eager", all(r["cuda_graph_replay_bitwise"] is True for r in ours if r["mode"] == "dropless-syncfree")
           if cuda() else NO_CUDA)
    _claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes: zero syncs under "
           "set_sync_debug_mode('error')",
           all(r["cuda_sync_free_step"] is True and r["cuda_syncs_forward"] == r["cuda_syncs_backward"] == 0
               for r in capacity) if cuda() else NO_CUDA)
    _claim(claims, "sync-free dispatcher, dropless: one sync per layer forward (the split sizes)",
           all(r["syncs_forward"] + r["syncs_backward"] == 1 for r in ours if r["mode"] == "dropless"))
    _claim(claims, "sync-free dispatcher: bit-identical to megatron's where it claims to be (dropless, capacity, "
           "zero-sync dropless)",
           all(r["bitwise_equal_to_megatron"] for r in ours if r["mode"] != "capacity-nopad"))
    return {"status": "ok", "rows": rows}


def section_offload(size, claims) -> dict:
    from megatron_ext import platform
    from megatron_ext.offload import canonical_modules, theory
    from megatron_ext.offload import manager as om
    from megatron_ext.platform import streams
    from megatron_ext.bench import offload as jobs
    from megatron_ext.training import parallel

    dtype = torch.bfloat16 if cuda() else torch.float32
    dtype_bytes = torch.finfo(dtype).bits // 8
    warmup, steps = size["offload_warmup"], size["offload_steps"]
    cases = []

    def step(chunks, c, batches):
        """One forward+backward through megatron-core's schedule (megatron_ext/bench/offload.py's run_step
        without its gradient copy, which would add to the measured device peak)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for p in chunks[0].parameters():
            p.grad.zero_()
        losses = get_forward_backward_func()(
            forward_step_func=jobs._forward_step, data_iterator=iter(batches), model=chunks[0],
            num_microbatches=c["microbatches"], seq_length=c["seq"], micro_batch_size=c["mbs"], forward_only=False,
        )
        return [x["lm loss"] for x in losses]

    def measure(chunks, c, mgr):
        def batches(s):  # fresh copies that only the forward holds, as a data loader's
            return [{k: v.clone() for k, v in b.items()} for b in jobs.batches(c, s)]

        for s in range(warmup):
            step(chunks, c, batches(s))
            if mgr is not None:
                mgr.synchronize()
        peaks, times, losses, grads = [], [], [], None
        before = mgr.stats["offloaded_bytes"] if mgr is not None else 0
        for s in range(warmup, warmup + steps):
            data = batches(s)
            if cuda():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            step_losses = step(chunks, c, data)
            if cuda():
                end.record()
            if mgr is not None:
                mgr.synchronize()
            if cuda():
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
                times.append(start.elapsed_time(end))
            losses += [x.item() for x in step_losses]
            if grads is None:  # the first measured step's gradients, on the host, for bitwise comparison
                grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in chunks[0].named_parameters()}
        per_step = ((mgr.stats["offloaded_bytes"] - before) // steps) if mgr is not None else 0
        return dict(peak=max(peaks) if peaks else NO_CUDA, time_ms=statistics.median(times) if times else NO_CUDA,
                    losses=losses, grads=grads, bytes_per_step=per_step)

    for kind, sets in (("dense", DENSE_SETS), ("moe", MOE_SETS)):
        shape = size["offload"][kind]
        chunks, config, c = jobs.build(**shape)
        try:
            for ch in chunks:  # jobs.build leaves torch's own norms where they were made (the host)
                ch.to(device=platform.current().device, dtype=dtype)
                for p in ch.parameters():
                    p.grad = torch.zeros_like(p)
            off = measure(chunks, c, None)
            for modules in sets:
                group = theory.group_bytes(
                    canonical_modules(modules), kind == "moe", seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"],
                    heads=c["heads"], topk=c["topk"], moe_ffn=c["moe_ffn"], shared_ffn=c["shared"], dtype_bytes=dtype_bytes)
                theo = theory.theoretical_saving(group, 1, None, 0, c["microbatches"], c["layers"], 1)
                options = jobs.offload_options(modules, pool_bytes=max(64 << 20, int(theo * 1.25) + (64 << 20)),
                                               chunk_bytes=4 << 20 if cuda() else 64 << 10,
                                               min_tensor_bytes=64 << 10 if cuda() else 1024, debug=False)
                mgr = om.attach(chunks, options)
                try:
                    on = measure(chunks, c, mgr)
                    stats = dict(mgr.stats)
                finally:
                    om.detach()
                equal = off["losses"] == on["losses"] and all(torch.equal(off["grads"][k], on["grads"][k]) for k in off["grads"])
                row = {
                    "model": kind, "modules": list(modules), "dtype": str(dtype).replace("torch.", ""),
                    "shape": {k: shape[k] for k in ("layers", "hidden", "heads", "seq", "mbs", "microbatches")},
                    "peak_off_bytes": off["peak"], "peak_on_bytes": on["peak"],
                    "theoretical_bytes": theo, "bytes_offloaded_per_step": on["bytes_per_step"],
                    "kept_on_device_bytes": sum(v for k, v in stats.items() if k.startswith("kept_")),
                    "step_ms_off": off["time_ms"], "step_ms_on": on["time_ms"],
                    "grads_bitwise_equal": bool(equal),
                }
                if cuda():
                    saved = off["peak"] - on["peak"]
                    row.update(saved_bytes=saved, R=round(saved / theo, 4) if theo else None,
                               step_overhead=round((on["time_ms"] - off["time_ms"]) / off["time_ms"], 4))
                else:
                    row.update(saved_bytes=NO_CUDA, R=NO_CUDA, step_overhead=NO_CUDA)
                cases.append(row)
        finally:
            om.detach()
            parallel.destroy()
            del chunks

    link = {"status": NO_CUDA}
    if cuda():
        link = {"status": "ok"}
        for n in (4 << 20, size["copy_bytes"]):
            dev_buf = torch.empty(n, dtype=torch.uint8, device="cuda")
            host_buf = streams.host_empty(n)
            d2h = timed_ms(lambda: host_buf.copy_(dev_buf, non_blocking=True), 5)
            h2d = timed_ms(lambda: dev_buf.copy_(host_buf, non_blocking=True), 5)
            link[f"d2h_gbps_{n >> 20}mib"] = round(n / (d2h * 1e-3) / 1e9, 2)
            link[f"h2d_gbps_{n >> 20}mib"] = round(n / (h2d * 1e-3) / 1e9, 2)
    _claim(claims, "offload: gradients and losses bit-identical with every module set",
           all(r["grads_bitwise_equal"] for r in cases))
    _claim(claims, "offload: bytes leave the device with every module set", all(r["bytes_offloaded_per_step"] > 0 for r in cases))
    _claim(claims, "offload: R >= 0.9 (torch.cuda.max_memory_allocated) with every module set",
           all(isinstance(r["R"], float) and r["R"] >= 0.9 for r in cases) if cuda() else NO_CUDA)
    return {"status": "ok", "cases": cases, "host_link": link}


def _train(argv) -> dict:
    import train

    from megatron_ext import moe, offload

    before = moe.installed
    try:
        history = train.main(list(argv))
        manager = offload.current()
        stats = dict(manager.stats) if manager is not None else {}
    finally:
        offload.detach()
    losses = [h.get("lm loss") for h in history]
    return {"argv": argv, "losses": losses, "finite": all(l is not None and math.isfinite(l) for l in losses),
            "offloaded_bytes": stats.get("offloaded_bytes", 0), "dispatchers_replaced": moe.installed - before}


def section_train(size, claims) -> dict:
    extra = ["--mock-data", "--train-iters", "3", "--log-interval", "1", *size["train_extra"]]
    dense = _train(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), *extra,
                    "--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                    "--activation-offload-min-tensor-kb", "1"])
    moe_run = _train(["--recipe", os.path.join(ROOT, "recipes", "tiny_moe.yaml"), *extra,
                      "--moe-sync-free-dispatcher"])
    _claim(claims, "train.py trains (finite losses) with activation offload on this platform's defaults",
           dense["finite"] and dense["offloaded_bytes"] > 0)
    _claim(claims, "train.py trains the MoE recipe with the sync-free dispatcher",
           moe_run["finite"] and moe_run["dispatchers_replaced"] > 0)
    return {"status": "ok", "dense_offload": dense, "moe_sync_free": moe_run}


PLAN_CASES = (("dense", "tiny_dense.yaml", []),
              ("dense offload", "tiny_dense.yaml", ["--activation-offload-modules", "qkv_linear", "core_attention",
                                                    "attn_proj", "--activation-offload-min-tensor-kb", "1"]),
              ("moe", "tiny_moe.yaml", []))


def section_planner(size, claims) -> dict:
    from megatron_ext.bench.plan import measure

    rows = []
    for name, recipe, flags in PLAN_CASES:
        argv = ["--recipe", os.path.join(ROOT, "recipes", recipe), "--mock-data", *size["plan_extra"], *flags]
        r = measure(argv)
        measured = sum(r["measured"].values())
        predicted = r["predicted"]["peak_bytes"]
        rows.append({"case": name, "predicted_peak_bytes": round(predicted), "measured_peak_bytes": measured,
                     "measured_by": "torch.cuda.max_memory_allocated" if cuda() else "live tensor bytes (CPU)",
                     "error": (predicted - measured) / measured, "megatron_estimate_bytes": round(r["megatron_estimate"])})
    within = all(abs(r["error"]) <= 0.05 for r in rows)
    _claim(claims, "planner: predicted peak within 5 % of torch.cuda.max_memory_allocated (PP=1)",
           within if cuda() else NO_CUDA)
    if not cuda():
        _claim(claims, "planner: predicted peak within 5 % of live tensor bytes on CPU (PP=1)", within)
    return {"status": "ok", "rows": rows}


def section_transformer_engine(size, claims) -> dict:
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is the result
        _claim(claims, "transformer-engine spec trains with offload hooks capturing bytes", "skipped: not importable")
        return {"status": f"skipped: transformer-engine not importable ({type(e).__name__}: {e})"}
    if not cuda():
        return {"status": NO_CUDA}
    run = _train(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), "--mock-data", "--train-iters", "3",
                  "--log-interval", "1", "--transformer-impl", "transformer_engine", *size["train_extra"],
                  "--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                  "--activation-offload-min-tensor-kb", "1"])
    _claim(claims, "transformer-engine spec trains with offload hooks capturing bytes",
           run["finite"] and run["offloaded_bytes"] > 0)
    return {"status": "ok", "version": _version("transformer-engine"), **run}


RUNNERS = {name: globals()[f"section_{name}"] for name in SECTIONS}


# ------------------------------------------------------------------------------------------------ output
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / 2**20:.1f} MiB"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return "-" if v is None else str(v)


def _table(rows: list, cols: list) -> list:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def markdown(doc: dict) -> str:
    lines = [f"# GPU check: {doc['device']}, {doc['date']}", "",
             f"`scripts/gpu_check.py{' --cpu-smoke' if doc['mode'] == 'cpu-smoke' else ''}`, {doc['elapsed_s']:.0f} s; "
             f"torch {doc['host']['torch']} (CUDA {doc['host']['cuda_runtime']}), megatron-core "
             f"{doc['host']['megatron_core']}, transformer-engine {doc['host']['transformer_engine'] or 'absent'}.", "",
             "## Claims", ""]
    lines += _table([{"claim": c["claim"], "holds": c["holds"]} for c in doc["claims"]], ["claim", "holds"])
    s = doc["sections"]
    lines += ["", "## Sections", ""]
    lines += _table([{"section": k, "status": v.get("status"), "seconds": v.get("seconds")} for k, v in s.items()],
                    ["section", "status", "seconds"])
    if s.get("cuda_facts", {}).get("status") == "ok":
        lines += ["", "## CUDA facts", ""]
        keys = ["backward_on_other_thread", "threading_local_seen_in_backward", "event_done_right_after_enqueue",
                "event_done_after_synchronize"]
        lines += _table([{"fact": k, "observed": s["cuda_facts"][k]} for k in keys], ["fact", "observed"])
    if s.get("multihot", {}).get("rows"):
        lines += ["", "## indices_to_multihot vs megatron-core", ""]
        lines += _table(s["multihot"]["rows"], ["tokens", "experts", "topk", "bitwise_equal_at_shape",
                                                "cuda_syncs_reference", "cuda_sync_free_ours", "time_reference_ms",
                                                "time_ours_ms", "time_ours_over_reference"])
    if s.get("moe_layer", {}).get("rows"):
        lines += ["", "## MoE layer, EP=1, forward+backward", ""]
        lines += _table(s["moe_layer"]["rows"], ["layer", "dispatcher", "mode", "syncs_forward", "syncs_backward",
                                                 "cuda_syncs_forward", "cuda_syncs_backward", "cuda_sync_free_step",
                                                 "step_ms", "bitwise_equal_to_megatron"])
    if s.get("offload", {}).get("cases"):
        lines += ["", "## Activation offload, PP=1", ""]
        lines += _table(s["offload"]["cases"], ["model", "modules", "dtype", "peak_off_bytes", "peak_on_bytes",
                                                "saved_bytes", "theoretical_bytes", "R", "bytes_offloaded_per_step",
                                                "step_ms_off", "step_ms_on", "step_overhead", "grads_bitwise_equal"])
        lines += ["", "Host link: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["offload"]["host_link"].items())]
    if s.get("planner", {}).get("rows"):
        lines += ["", "## Planner: predicted vs measured peak, PP=1", ""]
        lines += _table(s["planner"]["rows"], ["case", "predicted_peak_bytes", "measured_peak_bytes", "measured_by",
                                               "error", "megatron_estimate_bytes"])
    for name in ("train", "transformer_engine"):
        sec = s.get(name, {})
        runs = [v for v in sec.values() if isinstance(v, dict) and "losses" in v]
        if "losses" in sec:
            runs.append(sec)
        if runs:
            lines += ["", f"## {name}", ""]
            lines += _table([{"run": " ".join(r["argv"][1:2]).replace(ROOT + os.sep, ""), "losses": r["losses"],
                              "offloaded_bytes": r["offloaded_bytes"], "dispatchers_replaced": r["dispatchers_replaced"]}
                             for r in runs], ["run", "losses", "offloaded_bytes", "dispatchers_replaced"])
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def stdout_to_stderr():
    """While sections run, everything written to stdout (megatron's log handlers, train.py's log
    lines) goes to stderr: stdout carries only the final tables."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def single_process_env():
    """A world of one process for megatron's process groups; the caller's environment comes back."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    for key, value in zip(keys, ("0", "0", "1", "127.0.0.1", port)):
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (CI): the same code paths")
    ap.add_argument("--out", default=None, help="output folder (default: docs/gpu; with --cpu-smoke: nothing written "
                    "unless given)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=1080.0,
                    help="sections not started within this many seconds are reported skipped")
    a = ap.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
    if a.cpu_smoke and cuda():
        ap.error("--cpu-smoke is the CPU rehearsal; on a GPU machine run without it")
    if not a.cpu_smoke and not cuda():
        print("error: no CUDA device here; use --cpu-smoke to rehearse on CPU", file=sys.stderr)
        return 2
    size = SIZES["smoke" if a.cpu_smoke else "gpu"]
    out_dir = a.out if a.out is not None else (None if a.cpu_smoke else os.path.join(ROOT, "docs", "gpu"))

    from megatron_ext import platform

    t0 = time.time()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    device = device_name() if not a.cpu_smoke else "cpu (smoke)"
    doc = {"schema": SCHEMA, "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "date": date, "device": device,
           "host": host_info(), "sections": {}, "claims": [], "elapsed_s": 0.0}
    base = os.path.join(out_dir, f"{date}-{slug(device)}") if out_dir else None

    def write():
        doc["elapsed_s"] = round(time.time() - t0, 1)
        if base:
            os.makedirs(out_dir, exist_ok=True)
            with open(base + ".json", "w") as f:
                json.dump(doc, f, indent=1, default=str)

    with single_process_env(), stdout_to_stderr():
        started_pg = not torch.distributed.is_initialized()
        platform.init_distributed()
        try:
            for name in SECTIONS:
                if name not in sections:
                    doc["sections"][name] = {"status": "skipped: not selected"}
                    continue
                if time.time() - t0 > a.budget_s:
                    doc["sections"][name] = {"status": f"skipped: time budget ({a.budget_s:.0f} s) spent"}
                    continue
                print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
                ts = time.time()
                claims: list = []
                try:
                    result = RUNNERS[name](size, claims)
                except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others' evidence
                    result = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                    print(result["traceback"], file=sys.stderr)
                result["seconds"] = round(time.time() - ts, 1)
                for c in claims:
                    c["section"] = name
                doc["sections"][name] = result
                doc["claims"] += claims
                write()
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                from megatron_ext.training import parallel

                parallel.destroy()
            if started_pg and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    write()
    text = markdown(doc)
    if base:
        with open(base + ".md", "w") as f:
            f.write(text)
    print(text)
    if base:
        print(f"written: {base}.json, {base}.md", file=sys.stderr)
    ran = all(not v["status"].startswith("error") for v in doc["sections"].values())
    held = all(c["holds"] is True or isinstance(c["holds"], str) for c in doc["claims"])
    return 0 if ran and held else 1


if __name__ == "__main__":
    sys.exit(main())
