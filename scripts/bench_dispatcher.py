"""Benchmark + sync audit: megatron_ext's sync-free multihot conversion and token dispatcher against
megatron-core's own.

    .venv/bin/python scripts/bench_dispatcher.py [--json] [--ep 2] [--tokens 16384] [--dtype bfloat16]
    .venv/bin/python scripts/bench_dispatcher.py --smoke [--json]     # tiny sizes: seconds (the suite's run)

Part 1 (one process): indices_to_multihot vs megatron-core's _DeepepManager._indices_to_multihot:
syncs counted by the CPU SyncDetector (on CUDA additionally torch.cuda.set_sync_debug_mode("error")
around ours), bit equality over random inputs of many shapes, median time ratio.
Part 2 (--ep processes, gloo or NCCL): one MoELayer forward+backward per dispatcher and mode, in
--dtype (bf16 by default: the zero-sync mode's precision on CUDA), the syncs the detector finds on rank 0
(each site listed with --sites), and the median step time.
Part 3, dropless side by side: megatron's dropless dispatcher, ours with one sync, ours with none
(--moe-zero-sync-dropless) at budget factors 1.0 / 1.25 / worst case, under balanced and skewed
routing: syncs, all-to-all bytes, dispatch buffer bytes, peak live bytes of the step, step time,
pairs dropped, and whether outputs and gradients equal megatron's bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from megatron_ext import platform
from megatron_ext.measure.launch import run_world


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores), not measured on GPU"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_time(fn, reps, device):
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _interleaved_medians(fns, reps, device):
    for fn in fns:
        fn()
    _sync(device)
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def bench_multihot(tokens: int, topk: int, experts: int, reps: int) -> dict:
    from megatron_ext.moe.multihot import indices_to_multihot, reference_indices_to_multihot
    from megatron_ext.moe.sync_detector import SyncDetector

    device = platform.current().device
    gen = torch.Generator().manual_seed(0)

    def inputs(T, K, E, masked=0.3):
        idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K] if T else torch.empty(0, K, dtype=torch.long)
        idx = idx.masked_fill(torch.rand(T, K, generator=gen) < masked, -1)
        return idx.to(device), torch.rand(T, K, generator=gen).to(device)

    # bit equality over many shapes
    equal, cases = True, 0
    for T, K, E in [(0, 2, 4), (1, 1, 1), (7, 4, 4), (33, 6, 16), (128, 8, 256), (1000, 2, 8), (4096, 8, 64)]:
        for masked in (0.0, 0.3, 1.0):
            idx, probs = inputs(T, K, E, masked)
            rm, rp = reference_indices_to_multihot(idx, probs, E)
            om, op = indices_to_multihot(idx, probs, E, out_dtype=torch.float32)
            equal &= torch.equal(rm, om) and torch.equal(rp.view(torch.int32), op.view(torch.int32))
            cases += 1

    idx, probs = inputs(tokens, topk, experts)
    with SyncDetector() as det:
        reference_indices_to_multihot(idx, probs, experts)
    syncs_ref, sites_ref = det.count(), det.sites()
    with SyncDetector() as det:
        indices_to_multihot(idx, probs, experts)
    syncs_ours = det.count()
    cuda_debug_ok = None
    if device.type == "cuda":  # the real thing: any sync in ours raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            indices_to_multihot(idx, probs, experts)
            cuda_debug_ok = True
        except RuntimeError:
            cuda_debug_ok = False
        finally:
            torch.cuda.set_sync_debug_mode("default")

    # interleaved, so background load hits both alike; medians
    t_ref, t_ours = _interleaved_medians(
        [lambda: reference_indices_to_multihot(idx, probs, experts), lambda: indices_to_multihot(idx, probs, experts)],
        reps, device)
    out = {
        "syncs_reference": syncs_ref,
        "syncs_ours": syncs_ours,
        "bitwise_equal": bool(equal),
        "cases": cases,
        "time_ours_over_reference": round(t_ours / t_ref, 3),
        "time_reference_ms": round(t_ref * 1e3, 3),
        "time_ours_ms": round(t_ours * 1e3, 3),
        "shape": {"tokens": tokens, "topk": topk, "experts": experts},
        "sites_reference": sites_ref,
    }
    if cuda_debug_ok is not None:
        out["cuda_sync_debug_mode_error_passed"] = cuda_debug_ok
    return out


CONFIGS = [(d, m) for d in ("alltoall", "allgather") for m in ("dropless", "capacity", "capacity-nopad")]


def layer_job(opts) -> list:
    """On every rank of the --ep world: one MoELayer per dispatcher and mode (rank 0's rows are reported)."""
    from megatron_ext import seams
    from megatron_ext.moe import audit
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.training import parallel

    rows = []
    try:
        parallel.initialize(expert=opts["ep"])
        for dispatcher, mode in CONFIGS:
            spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, experts=opts["experts"], topk=opts["topk"],
                                   hidden=opts["hidden"], ffn=2 * opts["hidden"], ep=opts["ep"], dtype=opts["dtype"])
            x, g = audit.rank_inputs(spec, seq=opts["seq"], batch=2, seed=1)
            for ours in (False, True):
                seams.reset_moe_aux_loss_scale()
                layer = audit.build_layer(spec, seed=1, ours=ours)
                run = audit.run_layer(layer, x, g)

                def step():
                    xx = x.clone().requires_grad_(True)
                    out, _ = layer(xx)
                    run_backward(out, g)

                td = layer.token_dispatcher
                if ours:
                    a2a_rows = td.rows_sent if dispatcher == "alltoall" else None
                else:
                    splits = getattr(td, "input_splits", None)
                    a2a_rows = (sum(int(v) for v in splits) if splits is not None
                                else (td.num_out_tokens if dispatcher == "alltoall" else None))
                graph_safe = None
                if x.is_cuda and ours and mode != "dropless":  # the real check: any sync raises
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        step()
                        graph_safe = True
                    except RuntimeError:
                        graph_safe = False
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                torch.distributed.barrier()
                t = _median_time(step, opts["reps"], x.device)
                rows.append({
                    "dispatcher": ("multihot-" if ours else "megatron-") + dispatcher,
                    "mode": mode,
                    "syncs_forward": run.syncs_forward,
                    "syncs_backward": run.syncs_backward,
                    "a2a_rows_sent": None if a2a_rows is None else int(a2a_rows),
                    "step_ms": round(t * 1e3, 2),
                    **({} if graph_safe is None else {"cuda_sync_debug_mode_error_passed": graph_safe}),
                    "sites": run.sites,
                })
        seams.reset_moe_aux_loss_scale()
    finally:
        parallel.destroy()
    return rows


def bench_layers(opts) -> list:
    return run_world(opts["ep"], layer_job, opts=opts)[0]  # a worker that dies fails the run, naming its rank


BUDGETS = (1.0, 1.25, None)  # None: the worst case (nothing can overflow)


def _skew(layer, x, strength):
    """Inputs leaning towards rank 0's experts: add the mean of their router rows (same for every
    dispatcher: the routing is the layer's own)."""
    if not strength:
        return x
    w = layer.router.weight.detach()
    lean = w[: max(1, w.shape[0] // torch.distributed.get_world_size())].mean(0)
    return x + strength * lean / lean.norm() * x.norm(dim=-1, keepdim=True).mean()


def dropless_job(opts) -> list:
    """Rank 0's rows (counts summed over ranks where noted) for each dropless dispatcher."""
    from megatron_ext import seams
    from megatron_ext.measure.memtrack import LiveBytesTracker
    from megatron_ext.moe import audit
    from megatron_ext.moe.fixed_dispatch import OVERFLOW
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.training import parallel

    rows = []
    try:
        parallel.initialize(expert=opts["ep"])
        for dispatcher in ("alltoall", "allgather"):
            for routing, strength in (("balanced", 0.0), ("skewed", 2.0)):
                variants = [("megatron", "dropless", None, False), ("ours-one-sync", "dropless", None, True)]
                variants += [("ours-zero-sync", "dropless-syncfree", f, True) for f in BUDGETS]
                reference = None
                for name, mode, factor, ours in variants:
                    spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, experts=opts["experts"],
                                           topk=opts["topk"], hidden=opts["hidden"], ffn=2 * opts["hidden"],
                                           ep=opts["ep"], budget_factor=factor, dtype=opts["dtype"])
                    seams.reset_moe_aux_loss_scale()
                    layer = audit.build_layer(spec, seed=1, ours=ours)
                    x, g = audit.rank_inputs(spec, seq=opts["seq"], batch=2, seed=1)
                    x = _skew(layer, x, strength)
                    OVERFLOW.reset()
                    run = audit.run_layer(layer, x, g)
                    dropped, _ = OVERFLOW.take()
                    dropped = torch.zeros(1, dtype=torch.long) if dropped is None else dropped.cpu()
                    torch.distributed.all_reduce(dropped)
                    if reference is None:
                        reference = run
                    equal = (torch.equal(run.out, reference.out) and torch.equal(run.dx, reference.dx)
                             and all(torch.equal(run.dw[k], reference.dw[k]) for k in reference.dw))
                    equal_everywhere = torch.tensor([int(equal)])
                    torch.distributed.all_reduce(equal_everywhere, op=torch.distributed.ReduceOp.MIN)
                    equal = bool(equal_everywhere.item())
                    td = layer.token_dispatcher
                    H, elem = spec.hidden, x.element_size()
                    if mode == "dropless-syncfree":
                        sent_rows = td.rows_sent if dispatcher == "alltoall" else 0
                        buffer_rows = 3 * td.budget * (opts["ep"] if dispatcher == "alltoall" else 1)
                    elif ours:
                        sent_rows = td.rows_sent if dispatcher == "alltoall" else 0
                        buffer_rows = None
                    else:
                        splits = getattr(td, "input_splits", None)
                        sent_rows = sum(int(v) for v in splits) if splits is not None else 0
                        buffer_rows = None

                    def step():
                        xx = x.clone().requires_grad_(True)
                        out, _ = layer(xx)
                        run_backward(out, g)

                    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
                    with LiveBytesTracker(exclude_ptrs=params) as tracker:
                        step()
                    torch.distributed.barrier()
                    t = _median_time(step, opts["reps"], x.device)
                    rows.append({
                        "dispatcher": dispatcher,
                        "impl": name,
                        "mode": "dropless-syncfree" if mode == "dropless-syncfree" else "dropless",
                        "routing": routing,
                        "budget_factor": factor if mode == "dropless-syncfree" else None,
                        "budget_rows": getattr(td, "budget", None),
                        "syncs_forward": run.syncs_forward,
                        "syncs_backward": run.syncs_backward,
                        "a2a_bytes_sent": int(sent_rows) * H * elem,
                        "dispatch_buffer_bytes": None if buffer_rows is None else buffer_rows * H * elem,
                        "peak_live_bytes": int(tracker.peak),
                        "step_ms": round(t * 1e3, 2),
                        "overflowed_tokens": int(dropped.item()),
                        "bitwise_equal": bool(equal),
                    })
        seams.reset_moe_aux_loss_scale()
    finally:
        parallel.destroy()
    return rows


def bench_dropless(opts) -> list:
    return run_world(opts["ep"], dropless_job, opts=opts)[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ap.add_argument("--sites", action="store_true", help="list every sync site found (tables mode)")
    ap.add_argument("--tokens", type=int, default=16384, help="T for the multihot timing")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64, help="E (local experts) for the multihot timing")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--ep", type=int, default=2, help="processes (= expert-parallel size) for the layer audit")
    ap.add_argument("--layer-experts", type=int, default=8)
    ap.add_argument("--layer-topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layer-reps", type=int, default=5)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the MoE layers' precision (float32: the zero-sync experts' grouped GEMM would sync on CUDA, "
                    "and the detector counts it)")
    ap.add_argument("--smoke", action="store_true", help="seconds: T=512 K=4 E=16, 2 repeats; the layer audit "
                    "at 32 tokens per sequence, one timed repeat")
    a = ap.parse_args(argv)
    if a.smoke:
        a.tokens, a.topk, a.experts, a.reps, a.seq, a.layer_reps = 512, 4, 16, 2, 32, 1

    platform.setup()
    result = {"device": device_name()}
    result["multihot"] = bench_multihot(a.tokens, a.topk, a.experts, a.reps)
    layer_opts = {"ep": a.ep, "experts": a.layer_experts, "topk": a.layer_topk, "hidden": a.hidden, "seq": a.seq,
                  "reps": a.layer_reps, "dtype": a.dtype}
    result["moe_layer"] = bench_layers(layer_opts) + bench_dropless(layer_opts)
    result["moe_layer_setup"] = {"ep": a.ep, "experts": a.layer_experts, "topk": a.layer_topk,
                                 "hidden": a.hidden, "tokens_per_rank": a.seq * 2, "syncs_counted_on": "rank 0",
                                 "dtype": a.dtype}
    if a.json:
        print(json.dumps(result, indent=1))
        return result
    m = result["multihot"]
    print(f"device: {result['device']}")
    print(f"\nindices_to_multihot  T={a.tokens} K={a.topk} E={a.experts}")
    print(f"{'':24}{'syncs':>6}{'time ms':>10}")
    print(f"{'megatron-core reference':24}{m['syncs_reference']:>6}{m['time_reference_ms']:>10.3f}")
    print(f"{'megatron_ext (ours)':24}{m['syncs_ours']:>6}{m['time_ours_ms']:>10.3f}")
    print(f"bit-identical on {m['cases']} random cases: {m['bitwise_equal']}; "
          f"time ours/reference = {m['time_ours_over_reference']}")
    print(f"\nMoE layer forward+backward, EP{a.ep}, {a.layer_experts} experts top-{a.layer_topk}, "
          f"{a.seq * 2} tokens/rank, {a.dtype} (syncs on rank 0)")
    print(f"{'dispatcher':24}{'mode':16}{'fwd syncs':>10}{'bwd syncs':>10}{'a2a rows':>10}{'step ms':>10}")
    for r in result["moe_layer"]:
        if "impl" in r:
            continue
        rows = "-" if r["a2a_rows_sent"] is None else r["a2a_rows_sent"]
        print(f"{r['dispatcher']:24}{r['mode']:16}{r['syncs_forward']:>10}{r['syncs_backward']:>10}{rows:>10}"
              f"{r['step_ms']:>10.2f}")
        if a.sites:
            for s in r["sites"]:
                print(f"{'':26}{s}")
    print("\nDropless side by side (syncs on rank 0; overflowed pairs summed over ranks; bitwise vs megatron "
          "on every rank)")
    print(f"{'disp':10}{'routing':10}{'impl':16}{'budget':>8}{'fwd':>5}{'bwd':>5}{'a2a KiB':>9}{'buf KiB':>9}"
          f"{'peak KiB':>10}{'step ms':>9}{'overflow':>9}{'bitwise':>9}")
    for r in result["moe_layer"]:
        if "impl" not in r:
            continue
        budget = "-" if r["mode"] == "dropless" else ("worst" if r["budget_factor"] is None else r["budget_factor"])
        buf = "-" if r["dispatch_buffer_bytes"] is None else f"{r['dispatch_buffer_bytes'] / 1024:.0f}"
        print(f"{r['dispatcher']:10}{r['routing']:10}{r['impl']:16}{budget:>8}{r['syncs_forward']:>5}"
              f"{r['syncs_backward']:>5}{r['a2a_bytes_sent'] / 1024:>9.0f}{buf:>9}{r['peak_live_bytes'] / 1024:>10.0f}"
              f"{r['step_ms']:>9.2f}{r['overflowed_tokens']:>9}{str(r['bitwise_equal']):>9}")
    return result


if __name__ == "__main__":
    main()
