"""Model-parallel setup from the parsed arguments."""
from __future__ import annotations

import os

import torch

from megatron_ext import platform
from megatron_ext.training import parallel


def initialize_parallel(args) -> None:
    from megatron.core import config

    config.set_experimental_flag(bool(args.enable_experimental))  # as megatron's set_global_variables
    parallel.initialize(
        tensor=args.tensor_model_parallel_size,
        pipeline=args.pipeline_model_parallel_size,
        virtual_pipeline=args.virtual_pipeline_model_parallel_size,
        expert=args.expert_model_parallel_size,
        expert_tensor=args.expert_tensor_parallel_size,
        context=args.context_parallel_size,
        seed=args.seed,
    )
    log_restart(args)


def log_restart(args) -> None:
    """On a restarted world (torchrun --max-restarts, a requeued slurm job), rank 0 says so; the
    Checkpointer's line that follows names the checkpoint and iteration it resumes from."""
    restarts = platform.restart_count()
    if not restarts or torch.distributed.get_rank() != 0:
        return
    counts = ", ".join(f"{name}={os.environ[name]}" for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
                       if os.environ.get(name))
    where = f"the newest intact checkpoint under --load={args.load}" if args.load else "iteration 0 (no --load)"
    print(f"[restart] restart {restarts} of this job ({counts}): resuming from {where}", flush=True)
