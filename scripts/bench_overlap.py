#!/usr/bin/env python
"""Benchmark: TP communication left exposed under megatron's plain schedule vs ours
(--overlap-tp-comm-1f1b), on this machine (CPU + gloo), plus a structural figure.

    PYTHONPATH=. .venv/bin/python scripts/bench_overlap.py [--steps 7] [--timed-steps 21] [--json] [--out docs/overlap]
    PYTHONPATH=. .venv/bin/python scripts/bench_overlap.py --smoke [--layouts tp2]   # tiny: the suite's run

Runs in the CUDA-faithful CPU mode by default (--no-cuda-faithful: plain CPU semantics; on a GPU
the real CUDA rules apply and the mode is off): every backward on the autograd device thread and
pipeline messages under NCCL's rules, so the overlap measured is the one a GPU would get.
Per layout (TP=2 on 2 processes; TP=2 x PP=2 and TP=2 x PP=2 x VPP=2 on 4), in one run, alternating
the two schedules step by step on the same model, data and seed (no optimizer update, so every step
computes the same):
  * exposed TP comm per step: time the compute waited for TP collectives (CUDA events on the
    compute stream on a GPU; host time blocked in wait() on CPU), summed over the step, mean over
    ranks, median over steps, for plain and ours; their ratio;
  * step time: the forward-backward call (incl. finalize_model_grads, excl. the optimizer step),
    after a device synchronize, slowest rank per step, median over --timed-steps; ours / plain,
    also per step (neighbouring runs) with the median and quartiles of those ratios: one step here
    moves by up to ~10 % from the next, so the wall-clock figures take more steps than the
    exposed ones. Timed steps run as training does, with no recorder attached (the recorder's
    bookkeeping at every collective and hand-off costs ours more than plain); the --steps recorded
    steps that follow give the exposed figures and the timelines;
  * grads_bitwise_equal: every gradient of the last plain step == the last overlapped step's;
  * structural: one step of each with a FLOP counter: for every TP collective, the matmul FLOPs
    issued between its start and its wait, and with the link models of
    megatron_ext/schedules/costmodel.py the fraction of TP communication hidden on a GPU cluster,
    at the shape run here and at a GPT-3 13B-like layer shape (same structure, re-sized).
  * b_lane_collectives / b_lane_handed_off: TP collectives the paired backwards issued and how
    many of them were handed to the forward (the rest: the forward had already finished);
  * p2p_checked: the pipeline messages every rank issued (recorded) complete under NCCL's rules
    (megatron_ext/schedules/p2p.py), for both schedules;
  * a Chrome trace and a PNG timeline of one step (plain vs ours) per layout, under --out.
With --json the result is the only thing on stdout (table and logs on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


LAYOUTS = {
    "tp2": dict(world=2, tp=2, pp=1, vpp=None),
    "tp2xpp2": dict(world=4, tp=2, pp=2, vpp=None),
    "tp2xpp2xvpp2": dict(world=4, tp=2, pp=2, vpp=2),
}
TARGET_SHAPE = {"name": "GPT-3 13B-like layer (hidden 5120, seq 2048, mbs 1)",
                "hidden": 5120, "seq": 2048, "mbs": 1}
# MoE layouts (tiny_moe's structure, bf16: megatron's EP overlap needs bf16/fp16), each also run with
# megatron's own EP-overlap schedule (--overlap-moe-expert-parallel-comm) as the peer where it can run
MOE_LAYOUTS = {
    "moe-ep2": dict(world=2, tp=1, pp=1, vpp=None, ep=2),
    "moe-tp2xep2": dict(world=2, tp=2, pp=1, vpp=None, ep=2),
    "moe-ep2xpp2xvpp2": dict(world=4, tp=1, pp=2, vpp=2, ep=2),
}
MOE_TARGET_SHAPE = {"name": "DeepSeek-V3-like layer (hidden 7168, seq 4096, mbs 1)",
                    "hidden": 7168, "seq": 4096, "mbs": 1}


def _argv(tp, pp, vpp, shape):
    return (["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp else []) + [
        "--recipe", "recipes/tiny_dense.yaml",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--ffn-hidden-size", str(4 * shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
        "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
        "--micro-batch-size", str(shape["mbs"]), "--global-batch-size", str(shape["mbs"] * shape["mb"]),
    ]


def _moe_argv(tp, pp, vpp, ep, shape, world):
    dp = world // (tp * pp)  # shape["mb"] micro-batches per data-parallel rank, as the dense cases
    argv = (["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp else []) + [
        "--recipe", "recipes/tiny_moe.yaml", "--bf16",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "1",
        "--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
        "--ffn-hidden-size", str(4 * shape["hidden"]), "--moe-ffn-hidden-size", str(shape["hidden"]),
        "--num-attention-heads", str(shape["heads"]),
        "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
        "--micro-batch-size", str(shape["mbs"]), "--global-batch-size", str(shape["mbs"] * shape["mb"] * dp),
    ]
    return argv + (["--sequence-parallel"] if tp > 1 else [])


def _timed_step(args, schedule, model, num_mb, rec, contexts) -> tuple:
    """One forward-backward of ``schedule`` from zeroed gradients, the benchmark's seed and fresh
    data, every rank starting together, recorded by ``rec`` (the lanes' hook; None: not recorded,
    as in training) inside ``contexts``: (seconds, start time). On CUDA the step's device work is
    done before its time is read."""
    import contextlib

    import torch

    from megatron_ext.schedules import lanes
    from megatron_ext.training import data, parallel, step

    for chunk in model:
        chunk.zero_grad_buffer()
    parallel.set_seed(4321)
    iters = data.build_train_iterators(args, len(model))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    torch.distributed.barrier(group=torch.distributed.group.WORLD)
    if rec is not None:
        lanes.set_hook(rec)
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx)
            step.run_schedule(args, schedule, model, iters, num_mb)
        if cuda:
            torch.cuda.synchronize()
    finally:
        t1 = time.perf_counter()
        lanes.set_hook(None)
    return t1 - t0, t0


def moe_job(tp, pp, vpp, ep, steps, timed_steps, shape):
    """Runs on every rank: plain, ours and megatron's EP-overlap schedule on one MoE model."""
    import logging

    import torch

    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.seams import registry
    from bench.overlap import FlopCounter, NodeLog, Recorder
    from megatron_ext.platform import faithful
    from megatron_ext.schedules import group_kinds
    from megatron_ext.schedules.overlap_1f1b import forward_backward_overlap
    from megatron_ext.seams.schedules import plan_nodes_recorded
    from megatron_ext.training.run import Run

    import arguments

    registry.install_schedules_seams()
    run = Run.from_argv(_moe_argv(tp, pp, vpp, ep, shape, int(os.environ["WORLD_SIZE"])), parse=arguments.parse,
                        exit_on_dry_run=False)
    model, args, config = run.build(), run.args, run.config
    registry.install_schedules_seams()
    config.finalize_model_grads_func = finalize_model_grads
    group_kinds.set_groups()
    num_mb = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    # megatron's own refusals of its EP overlap for this layout (transformer_config.py:2669-2713)
    why_not = None
    if pp > 1 and not vpp:
        why_not = "megatron's EP overlap needs virtual pipeline stages with PP > 1 (transformer_config.py:2673)"

    def one(name, count_flops=False, record=True):
        config.overlap_moe_expert_parallel_comm = name == "peer"
        schedule = forward_backward_overlap if name == "ours" else get_forward_backward_func()
        rec = Recorder() if record else None
        nodes = NodeLog(rec)
        flop_ctx = FlopCounter(rec) if count_flops else _null()
        node_ctx = plan_nodes_recorded(nodes) if name == "peer" and record else _null()
        try:
            dt, _ = _timed_step(args, schedule, model, num_mb, rec, (flop_ctx, node_ctx))
        finally:
            config.overlap_moe_expert_parallel_comm = False
        grads = [p.main_grad.detach().clone() for c in model for p in c.parameters()]
        return dt, rec, nodes, grads

    names = ("plain", "ours") + (("peer",) if why_not is None else ())
    for n in names:
        one(n)  # warm-up
    times = {n: [] for n in names}
    exposed = {n: {"tp": [], "ep": []} for n in names}
    last = {}
    for i in range(max(steps, timed_steps)):
        order = names if i % 2 == 0 else tuple(reversed(names))
        if i < timed_steps:
            for n in order:
                times[n].append(one(n, record=False)[0])  # timed as training runs: no recorder
        if i < steps:
            for n in order:
                _, rec, _, grads = one(n)
                for kind in ("tp", "ep"):
                    exposed[n][kind].append(rec.exposed(kind))
                last[n] = grads
    equal = {n: all(torch.equal(a, b) for a, b in zip(last["plain"], last[n])) for n in names}

    structural, b_lane = {}, {}
    for n in names:
        _, rec, nodes, _ = one(n, count_flops=True)
        recs = [{"op": c.op, "kind": c.group, "nbytes": c.nbytes, "flops_between": c.flops_between,
                 "flops_attn": c.attn_flops_between, "flops_linear": c.flops_between - c.attn_flops_between,
                 "handed_off": c.handed_off} for c in rec.collectives if c.group in ("tp", "ep")]
        if n == "peer":  # EP all-to-alls: the compute megatron's plan puts beside each on a GPU
            recs = [r for r in recs if r["kind"] == "tp"] + [dict(r, kind="ep") for r in nodes.ep_records()]
        structural[n] = recs
        b_lane[n] = {k: rec.b_lane(k) for k in ("tp", "ep")}
    return {
        "rank": torch.distributed.get_rank(), "cuda_faithful": faithful.enabled(),
        "times": times, "exposed": exposed, "grads_equal": equal, "structural": structural,
        "num_microbatches": num_mb, "b_lane": b_lane, "why_not": why_not,
    }


def _wall(results, names) -> dict:
    """Each schedule's step times (slowest rank per step) and ours / plain per step: the steps
    alternate the schedules, so a step's ratio pairs two neighbouring runs and cancels slow drift
    of this shared machine; its median is the steadier figure next to the ratio of the medians."""
    steps = len(results[0]["times"]["plain"])
    times = {n: [max(r["times"][n][i] for r in results) for i in range(steps)] for n in names}
    paired = [o / p for o, p in zip(times["ours"], times["plain"])]
    q1, _, q3 = statistics.quantiles(paired, n=4) if steps > 1 else (paired[0],) * 3
    return {"timed_steps": steps, "step_times_s": times, "step_time_ratio_per_step": paired,
            "step_time_ratio_paired_median": statistics.median(paired),
            "step_time_ratio_paired_quartiles": [q1, q3]}


def summarize_moe(layout, lay, results, shape):
    from megatron_ext.schedules import costmodel

    names = list(results[0]["times"])
    steps = len(results[0]["exposed"]["plain"]["tp"])
    wall = _wall(results, names)
    med = {}
    for n in names:
        med[n] = {"step_s": statistics.median(wall["step_times_s"][n])}
        for kind in ("tp", "ep"):
            med[n][kind] = statistics.median(
                statistics.mean(r["exposed"][n][kind][i] for r in results) for i in range(steps))
    run_shape = {"hidden": shape["hidden"], "seq": shape["seq"], "mbs": shape["mbs"]}
    scale = costmodel.shape_scale(run_shape, MOE_TARGET_SHAPE)
    # TP inside a node (NVLink); DeepSeek-V3's expert parallelism spans nodes (InfiniBand)
    links = {"tp": (costmodel.NVLINK, lay["tp"]), "ep": (costmodel.INFINIBAND, lay["ep"])}

    def by_kind(n, sc):
        out = {}
        for kind, key in (("tp", "tp"), ("ep", "ep_a2a")):
            recs = [c for r in results for c in r["structural"][n] if c["kind"] == kind]
            link, size = links[kind]
            out[key] = costmodel.modeled_hidden(recs, link, tp=size, scale=sc)["hidden_fraction"] if recs else None
        return out

    case = {
        "layout": layout, "moe": True, "tp": lay["tp"], "ep": lay["ep"], "pp": lay["pp"], "vpp": lay["vpp"],
        "processes": len(results),
        "cuda_faithful": all(r["cuda_faithful"] for r in results),
        "num_microbatches": results[0]["num_microbatches"], "steps": steps,
        "exposed_comm_plain_s": med["plain"]["tp"] + med["plain"]["ep"],
        "exposed_comm_ours_s": med["ours"]["tp"] + med["ours"]["ep"],
        "exposed_by_kind_s": {n: {"tp": med[n]["tp"], "ep_a2a": med[n]["ep"]} for n in names},
        "step_time_plain_s": med["plain"]["step_s"],
        "step_time_ours_s": med["ours"]["step_s"],
        "step_time_ratio": med["ours"]["step_s"] / med["plain"]["step_s"],
        **wall,
        "modeled_hidden_by_kind": by_kind("ours", scale),
        "modeled_hidden_by_kind_as_run": by_kind("ours", (1.0, 1.0, 1.0)),
        "modeled_hidden_by_kind_plain": by_kind("plain", scale),
        "b_lane_collectives": sum(r["b_lane"]["ours"][k]["collectives"] for r in results for k in ("tp", "ep")),
        "b_lane_handed_off": sum(r["b_lane"]["ours"][k]["handed_off"] for r in results for k in ("tp", "ep")),
        "grads_bitwise_equal": all(r["grads_equal"]["ours"] for r in results),
    }
    case["exposed_ratio"] = (case["exposed_comm_ours_s"] / case["exposed_comm_plain_s"]
                             if case["exposed_comm_plain_s"] else None)
    case["modeled_hidden_fraction"] = case["modeled_hidden_by_kind"]["ep_a2a"]
    ran = "peer" in names
    case["peer"] = {
        "schedule": "megatron-ep-overlap", "ran": ran, "why_not": results[0]["why_not"],
        "modeled_hidden_by_kind": by_kind("peer", scale) if ran else None,
        "modeled_hidden_by_kind_as_run": by_kind("peer", (1.0, 1.0, 1.0)) if ran else None,
        "grads_bitwise_equal": all(r["grads_equal"]["peer"] for r in results) if ran else None,
        "step_time_s": med["peer"]["step_s"] if ran else None,
        "exposed_by_kind_s": case["exposed_by_kind_s"].get("peer"),
    }
    return case


def job(tp, pp, vpp, steps, timed_steps, shape):
    """Runs on every rank."""
    import logging

    import torch

    logging.getLogger("megatron").setLevel(logging.ERROR)
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.seams import registry, schedules as schedules_seams
    from bench.overlap import FlopCounter, Recorder
    from megatron_ext.platform import faithful, nccl_p2p
    from megatron_ext.schedules import group_kinds, overlap_1f1b, p2p, trace
    from megatron_ext.schedules.overlap_1f1b import forward_backward_overlap
    from megatron_ext.training.run import Run

    import arguments

    registry.install_schedules_seams()
    run = Run.from_argv(_argv(tp, pp, vpp, shape), parse=arguments.parse, exit_on_dry_run=False)
    model, args, config = run.build(), run.args, run.config
    config.finalize_model_grads_func = finalize_model_grads
    group_kinds.set_groups()
    num_mb = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)

    def one(schedule_name, count_flops=False, p2p_trace=None, record=True):
        schedule = forward_backward_overlap if schedule_name == "ours" else get_forward_backward_func()
        rec = Recorder() if record else None
        label = schedules_seams.label_plain_schedule_passes() if schedule_name == "plain" and record else _null()
        flop_ctx = FlopCounter(rec) if count_flops else _null()
        nccl_p2p.TRACE = p2p_trace
        try:
            dt, t0 = _timed_step(args, schedule, model, num_mb, rec, (label, flop_ctx))
        finally:
            nccl_p2p.TRACE = None
        return dt, rec, t0

    one("plain"), one("ours")  # warm-up
    times = {"plain": [], "ours": []}
    exposed = {"plain": [], "ours": []}
    last = {}
    timelines = {"plain": [], "ours": []}
    recorded_s = {"plain": [], "ours": []}
    for i in range(max(steps, timed_steps)):
        order = ("plain", "ours") if i % 2 == 0 else ("ours", "plain")
        if i < timed_steps:
            for name in order:
                times[name].append(one(name, record=False)[0])  # timed as training runs: no recorder
        if i < steps:
            for name in order:
                dt, rec, t0 = one(name)
                recorded_s[name].append(dt)
                exposed[name].append(rec.exposed("tp"))
                timelines[name].append(trace.to_dicts(rec, t0))
                if i == steps - 1:
                    grads = [p.main_grad.detach().clone() for c in model for p in c.parameters()]
                    last[name + "_grads"] = grads
    equal = all(torch.equal(a, b) for a, b in zip(last.pop("plain_grads"), last.pop("ours_grads")))

    structural, programs, b_lane = {}, {}, {}
    for name in ("plain", "ours"):
        recorded = []
        _, rec, _ = one(name, count_flops=True, p2p_trace=recorded)
        structural[name] = [
            {"op": c.op, "owner": c.owner, "lane": c.lane, "nbytes": c.nbytes,
             "flops_between": c.flops_between, "flops_attn": c.attn_flops_between,
             "flops_linear": c.flops_between - c.attn_flops_between, "handed_off": c.handed_off,
             "upstream_async": c.issued_async_by_upstream}
            for c in rec.collectives if c.group == "tp"
        ]
        names = overlap_1f1b.group_names()
        programs[name] = [p2p.Op(i.kind, i.peer, names.get(i.comm, i.comm), i.label, i.group)
                          if isinstance(i, p2p.Op) else i for i in p2p.from_trace(recorded)]
        b_lane[name] = rec.b_lane("tp")
    return {
        "rank": torch.distributed.get_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "cuda_faithful": faithful.enabled(),
        "times": times, "exposed": exposed, "grads_equal": equal,
        "timelines": timelines, "recorded_s": recorded_s, "structural": structural, "num_microbatches": num_mb,
        "p2p_programs": programs, "b_lane": b_lane,
    }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def summarize(layout, results, shape):
    from megatron_ext.schedules import costmodel, p2p

    steps = len(results[0]["exposed"]["plain"])
    wall = _wall(results, ("plain", "ours"))
    per_step = {}
    for name in ("plain", "ours"):
        per_step[name] = {
            "step_s": wall["step_times_s"][name],
            "exposed_s": [statistics.mean(r["exposed"][name][i] for r in results) for i in range(steps)],
            "recorded_step_s": [max(r["recorded_s"][name][i] for r in results) for i in range(steps)],
        }
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in per_step.items()}
    run_shape = {"hidden": shape["hidden"], "seq": shape["seq"], "mbs": shape["mbs"]}
    modeled = {}
    for name in ("plain", "ours"):
        recs = [c for r in results for c in r["structural"][name]]
        for link in costmodel.LINKS:
            key = "nvlink" if link is costmodel.NVLINK else "infiniband"
            modeled[f"{name}_{key}_as_run"] = costmodel.modeled_hidden(recs, link)["hidden_fraction"]
            modeled[f"{name}_{key}_13b_shape"] = costmodel.modeled_hidden(
                recs, link, scale=costmodel.shape_scale(run_shape, TARGET_SHAPE))["hidden_fraction"]
    ours_recs = [c for r in results for c in r["structural"]["ours"]]
    plain_recs = [c for r in results for c in r["structural"]["plain"]]
    verdicts = {name: p2p.check({r["rank"]: r["p2p_programs"][name] for r in results})
                for name in ("plain", "ours")}
    for name, verdict in verdicts.items():
        if not verdict.ok:
            print(f"{layout} {name}: pipeline messages fail NCCL's rules:\n{verdict.report()}",
                  file=sys.stderr)
    case = {
        "layout": layout,
        "processes": len(results),
        "cuda_faithful": all(r["cuda_faithful"] for r in results),
        "b_lane_collectives": sum(r["b_lane"]["ours"]["collectives"] for r in results),
        "b_lane_handed_off": sum(r["b_lane"]["ours"]["handed_off"] for r in results),
        "p2p_checked": all(v.ok for v in verdicts.values()),
        "p2p_messages": sum(isinstance(i, p2p.Op) for r in results for i in r["p2p_programs"]["ours"]),
        "num_microbatches": results[0]["num_microbatches"],
        "steps": steps,
        "exposed_comm_plain_s": med["plain"]["exposed_s"],
        "exposed_comm_ours_s": med["ours"]["exposed_s"],
        "exposed_ratio": med["ours"]["exposed_s"] / med["plain"]["exposed_s"],
        "hidden_fraction": 1.0 - med["ours"]["exposed_s"] / med["plain"]["exposed_s"],
        "step_time_plain_s": med["plain"]["step_s"],
        "step_time_ours_s": med["ours"]["step_s"],
        "step_time_ratio": med["ours"]["step_s"] / med["plain"]["step_s"],
        **wall,
        "modeled_hidden_fraction": modeled["ours_nvlink_13b_shape"],
        "modeled": modeled,
        "tp_collectives_per_step_all_ranks": len(ours_recs),
        "collectives_with_compute_between": {
            "plain": sum(1 for c in plain_recs if c["flops_between"] > 0),
            "ours": sum(1 for c in ours_recs if c["flops_between"] > 0),
        },
        "flops_between_per_step": {
            "plain": sum(c["flops_between"] for c in plain_recs),
            "ours": sum(c["flops_between"] for c in ours_recs),
        },
        "grads_bitwise_equal": all(r["grads_equal"] for r in results),
        "per_step": per_step,
    }
    return case


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=7,
                   help="recorded steps per schedule: exposed communication (median) and timelines")
    p.add_argument("--timed-steps", type=int, default=21,
                   help="timed steps per schedule, no recorder: the wall-clock figures (median)")
    p.add_argument("--layouts", default=None, help=f"of {','.join([*LAYOUTS, *MOE_LAYOUTS])} (default: all)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--cuda-faithful", action=argparse.BooleanOptionalAction, default=True,
                   help="run in the CUDA-faithful CPU mode (megatron_ext/platform/faithful.py); "
                   "without CUDA only")
    p.add_argument("--out", default=None, help="folder for the Chrome traces and PNGs")
    p.add_argument("--json", action="store_true", help="print the JSON result only (table on stderr)")
    p.add_argument("--smoke", action="store_true", help="seconds: one recorded and one timed step of a tiny model "
                   "(2 layers, hidden 64, seq 32, 2 micro-batches), the layouts given (default tp2)")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.timed_steps, a.layers, a.hidden, a.seq, a.microbatches = 1, 1, 2, 64, 32, 2
    a.layouts = a.layouts or ("tp2" if a.smoke else ",".join([*LAYOUTS, *MOE_LAYOUTS]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megatron_ext import platform

    platform.setup()
    import torch

    from megatron_ext.measure.launch import run_world
    from megatron_ext.platform import faithful
    from megatron_ext.schedules import costmodel, trace

    os.environ[faithful.ENV] = "1" if a.cuda_faithful else "0"  # the rank processes inherit it
    shape = {"hidden": a.hidden, "heads": a.heads, "seq": a.seq, "layers": a.layers, "mbs": a.mbs,
             "mb": a.microbatches}
    cases = []
    for layout in a.layouts.split(","):
        if layout in MOE_LAYOUTS:
            lay = MOE_LAYOUTS[layout]
            print(f"{layout}: {lay['world']} processes ...", file=sys.stderr, flush=True)
            results = run_world(lay["world"], moe_job, tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"],
                                ep=lay["ep"], steps=a.steps, timed_steps=a.timed_steps, shape=shape)
            cases.append(summarize_moe(layout, lay, results, shape))
            continue
        lay = LAYOUTS[layout]
        print(f"{layout}: {lay['world']} processes ...", file=sys.stderr, flush=True)
        results = run_world(lay["world"], job, tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"],
                            steps=a.steps, timed_steps=a.timed_steps, shape=shape)
        cases.append(summarize(layout, results, shape))
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            # the pictures show each schedule's median recorded step (by slowest-rank step time)
            steps = {}
            for n in ("plain", "ours"):
                st = cases[-1]["per_step"][n]["recorded_step_s"]
                i = sorted(range(len(st)), key=st.__getitem__)[len(st) // 2]
                steps[n] = {r["rank"]: r["timelines"][n][i] for r in results}
            trace.chrome_trace(steps, os.path.join(a.out, f"trace_{layout}.json"))
            trace.png(steps, os.path.join(a.out, f"timeline_{layout}.png"), rank=0,
                      title=f"{layout}: one step, {results[0]['num_microbatches']} micro-batches, "
                            f"hidden {a.hidden}, seq {a.seq}, {a.layers} layers (CPU + gloo"
                            f"{', CUDA-faithful mode' if cases[-1]['cuda_faithful'] else ''})")
    device = (f"cuda ({torch.cuda.get_device_name()}, nccl)" if torch.cuda.is_available()
              else f"cpu ({os.cpu_count()} cores, gloo); not measured on GPU")
    out = {
        "device": device,
        "model": shape,
        "link_models": [vars(link) for link in costmodel.LINKS],
        "modeled_target_shape": TARGET_SHAPE,
        "moe_modeled_target_shape": MOE_TARGET_SHAPE,
        "cases": cases,
    }
    table = _table(out)
    if a.json:
        print(table, file=sys.stderr)
        print(json.dumps(out, indent=1))
    else:
        print(table)
    return out


def _paired(case) -> str:
    q1, q3 = case["step_time_ratio_paired_quartiles"]
    return f"{case['step_time_ratio_paired_median']:.3f} ({q1:.3f}-{q3:.3f})"


def _moe_table(cases) -> list:
    def f(x):
        return "-" if x is None else f"{x:.1%}"

    lines = [f"{'MoE layout':18} {'exposed tp+ep plain':>19} {'ours':>8} {'step plain':>10} {'ours':>8} "
             f"{'ours/plain':>10} {'per step: median (quartiles)':>28} {'modeled ours tp / ep_a2a':>25} {'megatron EP overlap: ran, tp / ep_a2a, step':>44} "
             f"{'bitwise ours/megatron':>21}"]
    for c in cases:
        m, peer = c["modeled_hidden_by_kind"], c["peer"]
        pm = peer["modeled_hidden_by_kind"] or {}
        peer_txt = (f"{f(pm.get('tp'))} / {f(pm.get('ep_a2a'))}, {peer['step_time_s'] * 1e3:.0f}ms"
                    if peer["ran"] else f"no: {peer['why_not']}")
        lines.append(
            f"{c['layout']:18} {c['exposed_comm_plain_s'] * 1e3:17.1f}ms {c['exposed_comm_ours_s'] * 1e3:6.1f}ms "
            f"{c['step_time_plain_s'] * 1e3:8.1f}ms {c['step_time_ours_s'] * 1e3:6.1f}ms {c['step_time_ratio']:10.3f} "
            f"{_paired(c):>28} {f(m['tp']):>12} / {f(m['ep_a2a']):<10} {peer_txt:>44} "
            f"{str(c['grads_bitwise_equal'])} / {str(peer['grads_bitwise_equal'])}")
    return lines


def _table(out) -> str:
    moe = [c for c in out["cases"] if c.get("moe")]
    cases = [c for c in out["cases"] if not c.get("moe")]
    if not cases:
        return "\n".join([f"device: {out['device']}; model: {out['model']}"] + _moe_table(moe))
    hdr = (f"{'layout':12} {'exposed plain':>13} {'exposed ours':>12} {'ratio':>6} {'hidden':>7} "
           f"{'step plain':>10} {'step ours':>9} {'ours/plain':>10} {'per step: median (quartiles)':>28} "
           f"{'modeled NVL/IB (13B shape)':>27} "
           f"{'as run NVL':>10} {'B handed off':>12} {'p2p ok':>6} {'bitwise':>7}")
    lines = [f"device: {out['device']}; model: {out['model']}", hdr]
    for c in cases:
        m = c["modeled"]
        lines.append(
            f"{c['layout']:12} {c['exposed_comm_plain_s'] * 1e3:11.1f}ms {c['exposed_comm_ours_s'] * 1e3:10.1f}ms "
            f"{c['exposed_ratio']:6.2f} {c['hidden_fraction']:7.1%} {c['step_time_plain_s'] * 1e3:8.1f}ms "
            f"{c['step_time_ours_s'] * 1e3:7.1f}ms {c['step_time_ratio']:10.3f} {_paired(c):>28} "
            f"{m['ours_nvlink_13b_shape']:>12.1%} / {m['ours_infiniband_13b_shape']:<12.1%} "
            f"{m['ours_nvlink_as_run']:10.1%} {c['b_lane_handed_off']:>5}/{c['b_lane_collectives']:<6} "
            f"{str(c['p2p_checked']):>6} {str(c['grads_bitwise_equal']):>7}")
    lines.append("modeled, plain schedule (megatron's dgrad/wgrad overlap only): " + ", ".join(
        f"{c['layout']}: NVL {c['modeled']['plain_nvlink_13b_shape']:.1%} / "
        f"IB {c['modeled']['plain_infiniband_13b_shape']:.1%} (13B shape)" for c in cases))
    lines.append("CUDA-faithful mode: " + ", ".join(f"{c['layout']}: {c['cuda_faithful']}" for c in out["cases"]))
    if moe:
        lines += _moe_table(moe)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
