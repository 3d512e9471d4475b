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


def measure(argv: list) -> dict:
    """Job (every rank): one warm step, one measured step, and the planner's prediction."""
    import torch

    import arguments
    from megatron.core import parallel_state

    from megatron_ext import offload, planner, schedules
    from megatron_ext.bench.memtrack import CudaPeak, LiveBytesTracker, model_state_ptrs
    from megatron_ext.training import data, model as models, optimizer as optim, parallel, run, step

    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(list(argv))
    run.initialize_parallel(args)
    try:
        config = models.transformer_config(args)
        model = models.build_model(args, config)
        optimizer, scheduler = optim.build_optimizer(args, model)
        step.configure_schedule_hooks(args, config, model, optimizer)
        iterators = data.build_iterators(args, len(model), iteration=0)
        fb = schedules.get_forward_backward_func(args)
        step.train_step(args, model, optimizer, scheduler, iterators.train, fb)
        state = model_state_ptrs(model)
        params = _storages(p for c in model for p in c.parameters())
        grads = _storages(g for c in model for p in c.parameters()
                          for g in (getattr(p, "main_grad", None), p.grad))
        opt = {k: v for k, v in _storages(optimizer_state_tensors(optimizer)).items() if k not in state}
        mgr = offload.current()
        exclude = state | set(opt) | (mgr.pool.storage_ptrs() if mgr is not None else set())
        cuda = torch.cuda.is_available()
        tracker = CudaPeak() if cuda else LiveBytesTracker(exclude, "cpu")

        def tracked(**kw):
            with tracker:
                return fb(**kw)

        step.train_step(args, model, optimizer, scheduler, iterators.train, tracked)
        if mgr is not None:
            mgr.synchronize()
        from megatron_ext.planner.trace import global_buffer_bytes

        measured = dict(parameters=sum(params.values()), gradients=sum(grads.values()), optimizer=sum(opt.values()),
                        buffers=global_buffer_bytes(), activations=tracker.peak)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        first_in_stage = (parallel_state.get_tensor_model_parallel_rank() == 0
                          and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0)
        stats = dict(mgr.stats) if mgr is not None else None
    finally:
        offload.detach()
        step.release_schedule_hooks()
        models.release_models()
        parallel.destroy()
    prediction = planner.predict_memory(args)  # traces a tiny copy on this process (model parallel sizes 1)
    return dict(pp_rank=pp_rank, report=first_in_stage, measured=measured, predicted=prediction[pp_rank],
                megatron_estimate=megatron_estimate(args), offload_stats=stats)


# A cluster recipe scaled down to this machine: its structure (attention kind and heads, experts,
# top-k, norms, activation) kept, sizes divided so the ratios that decide activation memory stay
# close (heads x sequence / hidden, FFN / hidden, vocabulary / hidden), two pipeline stages.
SCALED_DOWN = ["--num-layers", "8", "--hidden-size", "64", "--ffn-hidden-size", "224", "--moe-ffn-hidden-size", "224",
               "--num-attention-heads", "32", "--num-query-groups", "8", "--kv-channels", "2", "--seq-length", "64",
               "--max-position-embeddings", "64", "--vocab-size", "500", "--make-vocab-size-divisible-by", "128",
               "--micro-batch-size", "1", "--global-batch-size", "8", "--pipeline-model-parallel-size", "2",
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


def validate_choice(recipe: str = "recipes/cluster/mixtral_8x7b.yaml", gpu: str = "h100") -> dict:
    """Job (every rank of a 2-process world). The planner on the cluster recipe, with the recompute
    the recipe has, for a budget halfway between its predicted peak without offload and with the
    best offload (so it cannot fit without); then the chosen configuration and the recipe without
    offload, scaled down (SCALED_DOWN) and measured. The scaled budget is the cluster budget times
    the ratio of the chosen configuration's predicted peaks (scaled-down / cluster), worst stage."""
    from megatron_ext import planner
    from megatron_ext.planner import cli, search
    from megatron_ext.planner import trace as tr

    _, full = cli.parse(["--recipe", recipe, "--gpu", gpu])
    given = (tr.recompute_of(full),)
    everything = planner.plan(full, gpu=gpu, memory_gb=1e6, top=10**6, recomputes=given)["candidates"]
    plain = next(c for c in everything if not any(f.startswith("--activation-offload") for f in c.flags))
    best = min((c for c in everything if c is not plain), key=lambda c: max(c.peak_bytes_per_stage))
    budget = (max(plain.peak_bytes_per_stage) + max(best.peak_bytes_per_stage)) / 2
    chosen = planner.plan(full, gpu=gpu, memory_gb=budget / search.GIB, recomputes=given)["candidates"][0]
    small = ["--recipe", recipe, *SCALED_DOWN]
    with_choice = measure([*small, *_choice_flags(chosen.flags), *SMALL_OFFLOAD])
    without = measure(small)
    return dict(budget_bytes=budget, chosen_flags=chosen.flags, chosen_peaks=chosen.peak_bytes_per_stage,
                plain_peaks=plain.peak_bytes_per_stage, with_choice=with_choice, without=without)
