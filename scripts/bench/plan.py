"""The planner's prediction against a measured step, per pipeline stage, on every rank of a world.

The measured run is train.py's own path (its argument parsing, builders, DDP, megatron's optimizer
and schedule, the data iterators): one step creates the optimizer state (and lets offload learn the
backward order), the next is measured. Bytes per rank:

- parameters, gradient buffers (DDP's), optimizer state: the distinct storages they occupy; megatron's
  global memory buffer (sequence-parallel gathers);
- activations: the most live bytes during the measured step's forward/backward schedule, from the
  independent tracker (``memtrack.LiveBytesTracker``, parameters, gradients and the offload pool
  excluded; on CUDA ``torch.cuda.max_memory_allocated``).

The prediction for the same arguments comes from ``megatron_ext.planner`` (a trace of a tiny copy
of the model at a smaller shape, scaled up), and megatron's theoretical estimate
(``megatron/training/theoretical_memory_usage.py``) is computed for the same case.
"""
from __future__ import annotations

import contextlib
import io
import os


def _storages(tensors) -> dict:
    out = {}
    for t in tensors:
        if t is not None and t.numel():
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()
    return out


def optimizer_state_tensors(optimizer) -> list:
    """Tensors the optimizer holds: Adam moments and main (fp32) parameter copies, for megatron's
    chained / mixed-precision / distributed optimizers."""
    import torch

    found = []
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in inner:
        torch_opt = getattr(opt, "optimizer", opt)
        for state in torch_opt.state.values():
            found += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        for group in torch_opt.param_groups:
            found += list(group["params"])
    return found


def megatron_estimate(args) -> float:
    """Megatron's theoretical bytes per GPU (its first stage), as scripts/estimate_memory.py takes it."""
    from megatron.training import theoretical_memory_usage as tmu

    micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    with contextlib.redirect_stdout(io.StringIO()):
        weights = tmu.compute_weight_and_optimizer_memory(args)
        if args.sequence_parallel and args.recompute_granularity == "selective":
            act = tmu.compute_activation_memory(args, num_microbatches=micro_batches)
        else:
            act = tmu.compute_activation_memory_without_sp(args, num_microbatches=micro_batches)
    return float(weights + act)


class _TrackSchedule:
    """A run's probe: ``tracker`` active around the forward/backward of the micro-batches."""

    def __init__(self, tracker):
        self.tracker = tracker

    def around_schedule(self, run, iteration):
        return self.tracker


def measure(argv: list, tracer=None) -> dict:
    """Job (every rank): one warm step, one measured step, and the planner's prediction (its trace
    from ``tracer``, a ``megatron_ext.planner.search.Tracer`` shared by runs of one model, if given)."""
    import torch

    from megatron.core import parallel_state

    from megatron_ext import offload, planner
    from megatron_ext.measure.memtrack import CudaPeak, LiveBytesTracker, model_state_ptrs
    from megatron_ext.planner.record import global_buffer_bytes
    from megatron_ext.training.run import Run

    import arguments

    with contextlib.redirect_stdout(io.StringIO()):
        run = Run.from_argv(list(argv), parse=arguments.parse)
    try:
        with run:
            run.step()  # warm: what persists across steps exists before the measured one
            model, args = run.model, run.args
            state = model_state_ptrs(model)
            params = _storages(p for c in model for p in c.parameters())
            grads = _storages(g for c in model for p in c.parameters()
                              for g in (getattr(p, "main_grad", None), p.grad))
            opt = {k: v for k, v in _storages(optimizer_state_tensors(run.optimizer)).items() if k not in state}
            mgr = offload.current()
            exclude = state | set(opt) | (mgr.pool.storage_ptrs() if mgr is not None else set())
            tracker = CudaPeak() if torch.cuda.is_available() else LiveBytesTracker(exclude, "cpu")
            run.probes.append(_TrackSchedule(tracker))  # the forward/backward's activations, not the optimizer's
            run.step()
            if mgr is not None:
                mgr.synchronize()
            measured = dict(parameters=sum(params.values()), gradients=sum(grads.values()), optimizer=sum(opt.values()),
                            buffers=global_buffer_bytes(), activations=tracker.peak)
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            first_in_stage = (parallel_state.get_tensor_model_parallel_rank() == 0
                              and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
            stats = dict(mgr.stats) if mgr is not None else None
    finally:
        offload.detach()  # the manager keeps the model while its counters stay readable
    from megatron_ext import platform

    # traces a tiny copy on this world; predicted for the backend measured here
    prediction = planner.predict_memory(args, backend=platform.current().backend,
                                        trace=tracer(args, None) if tracer is not None else None)
    return dict(pp_rank=pp_rank, report=first_in_stage, measured=measured, predicted=prediction[pp_rank],
                megatron_estimate=megatron_estimate(args), offload_stats=stats)


# A cluster recipe scaled down to this machine: its structure (attention kind and heads, experts,
# top-k, norms, activation) kept, sizes divided so the ratios that decide activation memory stay
# close (heads x sequence / hidden, FFN / hidden, vocabulary / hidden), two pipeline stages.
SCALED_DOWN = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "224", "--moe-ffn-hidden-size", "224",
               "--num-attention-heads", "32", "--num-query-groups", "8", "--kv-channels", "2", "--seq-length", "64",
               "--max-position-embeddings", "64", "--vocab-size", "500", "--make-vocab-size-divisible-by", "128",
               "--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "0", "--pipeline-model-parallel-size", "2",
               "--expert-model-parallel-size", "1", "--transformer-impl", "local", "--train-iters", "4",
               "--num-workers", "0", "--world-size", "2"]
SMALL_OFFLOAD = ["--activation-offload-min-tensor-kb", "1", "--activation-offload-chunk-mb", "0.0625",
                 "--activation-offload-pool-mb", "64"]


def _choice_flags(flags: list) -> list:
    """The chosen configuration's flags for the scaled-down run: the pool sized for this scale."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f == "--activation-offload-pool-mb":
            skip = True
            continue
        out.append(f)
    return out


def _one_replica_recipe(recipe: str) -> str:
    """The recipe for one data-parallel replica: the distributed optimizer shards nothing there, and
    is off, because on gloo its coalesced reduce-scatter copies the whole gradient buffer at the end
    of the backward (NCCL reduces in place), which the cluster would not see."""
    import tempfile

    import yaml

    with open(recipe) as f:
        keys = yaml.safe_load(f)
    keys.update(use_distributed_optimizer=False, overlap_param_gather=False)
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="one_replica_")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(keys, f)
    return path


def _activation_part(stage: dict) -> float:
    c = stage["components"]
    return c["activations"] + c["working_set"] + c["offload_removed"]


def validate_choice(recipe: str = "recipes/cluster/mixtral_8x7b.yaml", gpu: str = "h100") -> dict:
    """Job (every rank of a 2-process world). The planner on the cluster recipe, with the recompute
    the recipe has, for a budget three quarters of the way from its predicted peak with the best
    offload to the one without (so it cannot fit without); then the recipe scaled down (SCALED_DOWN),
    measured with the chosen configuration and without offload.

    The scaled budget keeps what the cluster budget leaves for activations: with S the model state
    and buffers and A the activation peak without offload of the most loaded stage, the cluster
    budget is S + phi x A; the scaled budget is S' + phi x A' with S', A' predicted for the scaled-down
    recipe (its most loaded stage)."""
    import torch.distributed as dist

    from megatron_ext import planner
    from megatron_ext.planner import cli, search
    from megatron_ext.planner.run import recompute_of

    import arguments

    # the local spec (--assume-no-te): what the scaled-down run measures on this machine
    _, full, _ = cli.parse(["--recipe", recipe, "--gpu", gpu, "--num-workers", "0", "--transformer-impl", "local",
                            "--assume-no-te"], "--", arguments.parse)
    given, tracer = (recompute_of(full),), search.Tracer()
    everything = planner.plan(full, gpu=gpu, memory_gb=1e6, top=10**6, recomputes=given, tracer=tracer)["candidates"]
    plain = next(c for c in everything if not any(f.startswith("--activation-offload") for f in c.flags))
    best = min((c for c in everything if c is not plain), key=lambda c: max(c.peak_bytes_per_stage))
    low, high = max(best.peak_bytes_per_stage), max(plain.peak_bytes_per_stage)
    budget = low + 0.75 * (high - low)
    chosen = planner.plan(full, gpu=gpu, memory_gb=budget / search.GIB, recomputes=given, tracer=tracer)["candidates"][0]
    worst = max(plain.stages, key=lambda st: st["peak_bytes"])
    phi = (budget - (worst["peak_bytes"] - _activation_part(worst))) / _activation_part(worst)
    small = ["--recipe", _one_replica_recipe(recipe), *SCALED_DOWN]
    try:
        small_tracer = search.Tracer()  # offload does not change what the model saves: one trace for both
        with_choice = measure([*small, *_choice_flags(chosen.flags), *SMALL_OFFLOAD], small_tracer)
        without = measure(small, small_tracer)
    finally:
        os.unlink(small[1])

    def stage_max(m):  # the most loaded rank of each stage, over the world
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (m["pp_rank"], sum(m["measured"].values()), m["predicted"]))
        return rows

    with_rows, without_rows = stage_max(with_choice), stage_max(without)
    w_small = max((r[2] for r in without_rows), key=lambda p: p["peak_bytes"])
    scaled_budget = (w_small["peak_bytes"] - _activation_part(w_small)) + phi * _activation_part(w_small)
    return dict(budget_bytes=budget, chosen_flags=chosen.flags, chosen_peaks=chosen.peak_bytes_per_stage,
                plain_peaks=plain.peak_bytes_per_stage, phi=phi, scaled_budget_bytes=scaled_budget,
                measured_with_choice=max(r[1] for r in with_rows), measured_without=max(r[1] for r in without_rows),
                predicted_with_choice=max(r[2]["peak_bytes"] for r in with_rows),
                predicted_without=w_small["peak_bytes"])


def plan_published(name: str) -> dict:
    """Job (one rank): the planner on a published run as given (``megatron_ext.planner.published``),
    its predicted peak and throughput beside the published figures."""
    import arguments

    from megatron_ext.planner import cli
    from megatron_ext.planner.published import CASES, GIB

    c = CASES[name]
    _, _, report = cli.run([*c["argv"], "--gpu", c["gpu"]], "--", arguments.parse, refuse=False)
    g = report["as_given"]
    return dict(case=name, gpu=c["gpu"], source=c["source"], published_peak_gib=c["peak_gib"],
                predicted_peak_gib=max(g["peak_bytes_per_stage"]) / GIB,
                published_tokens_per_s_per_gpu=c["tokens_per_s_per_gpu"],
                predicted_tokens_per_s_per_gpu=g["tokens_per_s_per_gpu"], fits_as_given=g["fits"],
                model_tflops_per_gpu=g["model_tflops_per_gpu"], time=g["time"],
                peak_gib_per_stage=[p / GIB for p in g["peak_bytes_per_stage"]],
                winner=report["candidates"][0]["flags"] if report["candidates"] else None)
