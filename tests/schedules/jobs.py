"""Job functions for tests/schedules (run on every rank of a persistent gloo world)."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import torch

import arguments

RECIPES = {"dense": "recipes/tiny_dense.yaml", "moe": "recipes/tiny_moe.yaml"}


def argv_for(kind: str, tp: int, pp: int = 1, vpp: int | None = None, extra=()) -> list:
    argv = [
        "--recipe", RECIPES[kind],
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
        # under a pipeline, four layers (a layer per model chunk with two virtual stages; the share of
        # hand-offs with compute between, checked below, is of a stage's layers); without one, two:
        # the hand-offs are per collective, one layer after another is what a step needs
        "--num-layers", "4" if pp > 1 else "2",
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
    """The project's bring-up (megatron_ext/training/run.py: parse -> parallel init -> model chunks
    with DDP), left initialised for the job (the pool's teardown destroys it)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_ext.training import data
    from megatron_ext.training.run import Run

    run = Run.from_argv(argv, exit_on_dry_run=False, parse=arguments.parse)
    model, args, config = run.build(), run.args, run.config
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
        "cp_collectives": sum(1 for c in rec.collectives if c.group == "cp"),
        "cp_handed_off": sum(1 for c in rec.collectives if c.group == "cp" and c.handed_off),
        "cp_handed_off_with_compute": sum(1 for c in rec.collectives
                                          if c.group == "cp" and c.handed_off and c.flops_between > 0),
        "cp_flops_between": sum(c.flops_between for c in rec.collectives if c.group == "cp"),
        "cp_handed_off_by_lane": sorted({c.lane for c in rec.collectives if c.group == "cp" and c.handed_off}),
        "flops_between_total": sum(c.flops_between for c in tp),
        "per_owner_lane": sorted({(c.owner, c.lane) for c in tp}),
        "b_lane": rec.b_lane("tp"),
        "b_lane_ep": rec.b_lane("ep"),
        "exposed_s": rec.exposed("tp"),
    }


@contextlib.contextmanager
def faithful_mode(on):
    """The CUDA-faithful CPU mode on/off for this job (None: as the suite set it)."""
    from megatron_ext.platform import faithful

    old = os.environ.get(faithful.ENV)
    if on is not None:
        os.environ[faithful.ENV] = "1" if on else "0"
    try:
        yield faithful.enabled()
    finally:
        if old is None:
            os.environ.pop(faithful.ENV, None)
        else:
            os.environ[faithful.ENV] = old


def _p2p_program(trace, names):
    """A recorded p2p trace as the checker's program, communicators named as the schedule names
    them (group name -> "act_up", ...; megatron's own groups keep their names)."""
    from megatron_ext.schedules import p2p

    return [p2p.Op(i.kind, i.peer, names.get(i.comm, i.comm), i.label, i.group)
            if isinstance(i, p2p.Op) else i for i in p2p.from_trace(trace)]


def check_bitwise(kind: str = "dense", tp: int = 2, pp: int = 1, vpp: int | None = None, extra=(),
                  only: str | None = None, debug_after: float = 0, second: str = "ours",
                  serial_pairs: bool = False, faithful: bool | None = None):
    """Plain megatron schedule vs ours on the same model, data and seed: every loss and every
    gradient compared bit for bit, plus counts of what the overlap did, and the pipeline messages
    each schedule issued (as p2p-checker programs)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_ext.seams import registry
    from bench.overlap import FlopCounter, Recorder
    from megatron_ext.platform import nccl_p2p
    from megatron_ext.schedules import group_kinds, lanes, overlap_1f1b
    from megatron_ext.schedules.overlap_1f1b import forward_backward_overlap

    registry.install_schedules_seams()  # so the plain schedule's collectives are recorded too
    args, config, model, data = build(argv_for(kind, tp, pp, vpp, extra))
    registry.install_schedules_seams()  # again: a second build in one job tears the last run's seams down
    out = {}
    runs = {}
    if debug_after:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(debug_after, exit=True, file=sys.stderr)
    lanes.Pair.SERIAL = serial_pairs
    second_schedule = forward_backward_overlap if second == "ours" else get_forward_backward_func()
    with faithful_mode(faithful) as on:
        out["cuda_faithful"] = on
        for name, schedule in (("plain", get_forward_backward_func()), ("ours", second_schedule)):
            if only and name != only:
                continue
            rec = Recorder()
            lanes.set_hook(rec)
            group_kinds.set_groups()
            nccl_p2p.TRACE = []
            pairs_before = overlap_1f1b.STATS["forward_pairs"]
            t0 = time.perf_counter()
            try:
                with FlopCounter(rec):
                    runs[name] = one_step(args, model, data, schedule)
            finally:
                lanes.set_hook(None)
                trace, nccl_p2p.TRACE = nccl_p2p.TRACE, None
            out[f"{name}_time"] = time.perf_counter() - t0
            out[name] = _summary(rec)
            out[name]["offload"] = _offload_stats()
            out[name]["p2p_program"] = _p2p_program(trace, overlap_1f1b.group_names())
            out[name]["pair_warmup"] = name == "ours" and overlap_1f1b.STATS["pair_warmup"]
            out[name]["forward_pairs"] = overlap_1f1b.STATS["forward_pairs"] - pairs_before
    lanes.Pair.SERIAL = False
    from megatron.core import parallel_state

    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    out["pp_ranks"] = torch.distributed.get_process_group_ranks(
        parallel_state.get_pipeline_model_parallel_group())
    out["num_microbatches"] = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    out["microbatch_group"] = config.microbatch_group_size_per_vp_stage
    out["chunks"] = len(model)
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
    from megatron_ext.schedules import lane_state

    original = lane_state.rng_restore
    lane_state.rng_restore = lambda state: None
    try:
        return check_bitwise("dense", tp=2, extra=RECOMPUTE)
    finally:
        lane_state.rng_restore = original


def check_thread_local_lanes(faithful: bool):
    """Negative control: the lane looked up from the thread that asks (a thread-local, as an
    earlier design did) instead of from the pair's baton. Results stay bit-identical either way;
    under the CUDA-faithful mode the backward's collectives come from the autograd device thread,
    which is neither lane's thread, so none of them is handed off."""
    from megatron_ext.schedules import lanes

    def thread_local_lane():
        pair = lanes._PAIR
        me = threading.current_thread()
        if pair is None:
            return None
        return next((lane for lane in (pair.f, pair.b) if lane.thread is me), None)

    original = lanes.current_lane
    lanes.current_lane = thread_local_lane
    try:
        return check_bitwise("dense", tp=2, faithful=faithful)
    finally:
        lanes.current_lane = original


def check_p2p_layout_deadlock(layout: str, vpp: int = 2):
    """Our schedule alone at PP2 x VPP2 (TP1: no lanes needed) with the pipeline communicators
    laid out as `layout`, in the CUDA-faithful mode. Returns how it ended and how long it took."""
    from megatron_ext.platform import nccl_p2p
    from megatron_ext.schedules import overlap_1f1b

    args, _config, model, data = build(argv_for("dense", 1, 2, vpp))
    old = overlap_1f1b.P2P_LAYOUT
    overlap_1f1b.P2P_LAYOUT = layout
    t0 = time.perf_counter()
    try:
        with faithful_mode(True):
            one_step(args, model, data, overlap_1f1b.forward_backward_overlap)
        return {"completed": True, "seconds": time.perf_counter() - t0}
    except nccl_p2p.P2PDeadlock as e:
        return {"completed": False, "seconds": time.perf_counter() - t0, "error": str(e)}
    finally:
        overlap_1f1b.P2P_LAYOUT = old


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


EP_DISPATCHERS = {
    "alltoall": [],
    "allgather": ["--moe-token-dispatcher-type", "allgather"],
    "sync_free": ["--moe-sync-free-dispatcher"],
    "zero_sync": ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"],
}


def check_ep_only(dispatchers=tuple(EP_DISPATCHERS), extra=()):
    """TP1 x EP2 MoE, one model build per dispatcher: plain vs ours bit for bit (check_bitwise);
    the flag's own validate accepts the layout (an EP collective to hide)."""
    out = {}
    for name in dispatchers:
        argv = argv_for("moe", 1, extra=["--expert-model-parallel-size", "2",
                                         *EP_DISPATCHERS[name], *extra])
        arguments.parse(argv + ["--overlap-tp-comm-1f1b", "--world-size", "2", "--dry-run"],
                        exit_on_dry_run=False)
        r = check_bitwise("moe", tp=1, extra=["--expert-model-parallel-size", "2",
                                              *EP_DISPATCHERS[name], *extra])
        from megatron_ext import moe

        r["dispatcher_installed"] = moe.installed
        out[name] = r
    return out


MEGATRON_EP_OVERLAP = ["--overlap-moe-expert-parallel-comm"]
OFFLOAD_ALL_MOE = ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj", "router_fc1",
                   "moe_act", "router_fc2", "--activation-offload-min-tensor-kb", "0"]


def train_digests(base: list, variants: dict) -> dict:
    """train.main on this rank for each variant (base argv + its flags): per-iteration log
    history, hashes of every parameter and gradient after training, and bytes offloaded per
    hooked module (tests/training/jobs_zoo.train_digest)."""
    from megatron.core.pipeline_parallel import schedules as S

    from tests.training.jobs_zoo import train_digest

    calls = {"n": 0}
    originals = {}
    for name in ("combined_1f1b_schedule_for_no_pipelining", "combined_1f1b_schedule_for_interleaved_pipelining"):
        originals[name] = orig = getattr(S, name)

        def counted(*a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(*a, **k)

        setattr(S, name, counted)
    out = {}
    try:
        for name, extra in variants.items():
            before = calls["n"]
            out[name] = train_digest(list(base) + list(extra))
            out[name]["combined_1f1b_calls"] = calls["n"] - before
    finally:
        for name, orig in originals.items():
            setattr(S, name, orig)
    return out
