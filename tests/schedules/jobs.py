"""Job functions for tests/schedules (run on every rank of a persistent gloo world)."""
from __future__ import annotations

import time

import torch

RECIPES = {"dense": "recipes/tiny_dense.yaml", "moe": "recipes/tiny_moe.yaml"}


def argv_for(kind: str, tp: int, pp: int = 1, vpp: int | None = None, extra=()) -> list:
    argv = [
        "--recipe", RECIPES[kind],
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "8",
        # dropout on: proves the forward's RNG stream is untouched by the interleaving
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    ]
    if vpp:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    if kind == "moe" and tp > 1:
        argv += ["--sequence-parallel"]
    return argv + list(extra)


def build(argv):
    """The project's builders (arguments.parse -> parallel init -> model chunks with DDP)."""
    import arguments
    from megatron.core.distributed import finalize_model_grads

    from megatron_ext.training import data, model as models, run

    args = arguments.parse(argv, exit_on_dry_run=False)
    run.initialize_parallel(args)
    config = models.transformer_config(args)
    model = models.build_model(args, config)
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return args, config, model, data


def one_step(args, model, data, schedule, seed: int = 4321):
    """zero grads, reseed, fresh data, one forward/backward; returns (losses, {name: grad})."""
    from megatron_ext.training import parallel, step

    for chunk in model:
        chunk.zero_grad_buffer()
    parallel.set_seed(seed)
    iters = data.build_train_iterators(args, len(model))
    num_mb = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    losses = step.run_schedule(args, schedule, model, iters, num_mb)
    grads = {}
    for ci, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            g = getattr(p, "main_grad", None)
            grads[f"{ci}.{name}"] = (g if g is not None else p.grad).detach().clone()
    return [float(x["lm loss"][0] / x["lm loss"][1]) for x in losses], grads, torch.get_rng_state()


def _offload_stats():
    """Bytes our activation offload moved in this run (None when it is off)."""
    from megatron_ext import offload

    manager = offload.current()
    if manager is None:
        return None
    manager.synchronize()
    stats = dict(manager.stats)
    manager.reset_stats()
    return stats


def _summary(rec):
    from megatron_ext.schedules.lanes import Recorder  # noqa: F401

    tp = [c for c in rec.collectives if c.group == "tp"]
    return {
        "tp_collectives": len(tp),
        "tp_async_issued": sum(1 for c in tp if not c.op.endswith("_list")),
        "tp_handed_off": sum(1 for c in tp if c.handed_off),
        "tp_handed_off_with_compute": sum(1 for c in tp if c.handed_off and c.flops_between > 0),
        "upstream_async": sum(1 for c in tp if c.issued_async_by_upstream),
        "upstream_async_with_compute": sum(
            1 for c in tp if c.issued_async_by_upstream and c.flops_between > 0
        ),
        "ep_collectives": sum(1 for c in rec.collectives if c.group == "ep"),
        "ep_handed_off": sum(1 for c in rec.collectives if c.group == "ep" and c.handed_off),
        "flops_between_total": sum(c.flops_between for c in tp),
        "per_owner_lane": sorted({(c.owner, c.lane) for c in tp}),
        "exposed_s": rec.exposed("tp"),
    }


def check_bitwise(kind: str = "dense", tp: int = 2, pp: int = 1, vpp: int | None = None, extra=(),
                  only: str | None = None, debug_after: float = 0, second: str = "ours",
                  serial_pairs: bool = False):
    """Plain megatron schedule vs ours on the same model, data and seed: every loss and every
    gradient compared bit for bit, plus counts of what the overlap did."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.schedules import lanes
    from megatron_ext.schedules.overlap_1f1b import forward_backward_overlap

    from megatron_ext import seams

    seams.install_schedules_seams()  # so the plain schedule's collectives are recorded too
    args, config, model, data = build(argv_for(kind, tp, pp, vpp, extra))
    out = {}
    runs = {}
    if debug_after:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(debug_after, exit=True, file=sys.stderr)
    lanes.Pair.SERIAL = serial_pairs
    second_schedule = forward_backward_overlap if second == "ours" else get_forward_backward_func()
    for name, schedule in (("plain", get_forward_backward_func()), ("ours", second_schedule)):
        if only and name != only:
            continue
        rec = lanes.Recorder(count_flops=True)
        lanes.set_recorder(rec)
        lanes.set_groups()
        t0 = time.perf_counter()
        try:
            with lanes.FlopCounter():
                runs[name] = one_step(args, model, data, schedule)
        finally:
            lanes.set_recorder(None)
        out[f"{name}_time"] = time.perf_counter() - t0
        out[name] = _summary(rec)
        out[name]["offload"] = _offload_stats()
    lanes.Pair.SERIAL = False
    if only:
        return out
    (lp, gp, rp), (lo, go, ro) = runs["plain"], runs["ours"]
    out["losses_plain"], out["losses_ours"] = lp, lo
    out["losses_equal"] = lp == lo
    out["n_grads"] = len(gp)
    out["grad_mismatch"] = [k for k in gp if not torch.equal(gp[k], go[k])]
    out["max_abs_diff"] = max([float((gp[k] - go[k]).abs().max()) for k in gp] + [0.0])
    out["grads_nonzero"] = sum(1 for g in gp.values() if g.abs().sum() > 0)
    out["rng_equal"] = torch.equal(rp, ro)
    return out


RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]


def check_without_rng_swap():
    """Negative control: full recompute re-runs each layer's forward (with its TP collectives and
    dropout) inside the backward, setting the RNG to the saved forward state; without the per-lane
    RNG swap the other lane's forward draws from that state and results change."""
    from megatron_ext.schedules import lanes

    original = lanes._rng_restore
    lanes._rng_restore = lambda state: None
    try:
        return check_bitwise("dense", tp=2, extra=RECOMPUTE)
    finally:
        lanes._rng_restore = original


def which_schedule():
    import argparse

    from megatron_ext.schedules import get_forward_backward_func
    from megatron_ext.training import parallel

    parallel.initialize(tensor=2)
    on = get_forward_backward_func(argparse.Namespace(overlap_tp_comm_1f1b=True))
    off = get_forward_backward_func(argparse.Namespace(overlap_tp_comm_1f1b=False))
    return {"on": on.__name__, "off": off.__name__}


def train_losses(argv: list) -> dict:
    """train.main(argv) (the project's training loop) and how often our schedule ran."""
    import train as entry

    from megatron_ext.schedules import overlap_1f1b

    before = dict(overlap_1f1b.STATS)
    history = entry.main(list(argv))
    return {
        "losses": [h["lm loss"] for h in history],
        "grad_norms": [h["grad norm"] for h in history],
        "calls": overlap_1f1b.STATS["calls"] - before["calls"],
        "pairs": overlap_1f1b.STATS["pairs"] - before["pairs"],
    }
