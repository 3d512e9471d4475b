"""Model-parallel state: initialise megatron-core's process groups for one run, tear them down after.

Re-entrant, so one process can run several layouts in a row (persistent test workers)."""
from __future__ import annotations

import torch

from megatron_ext import platform, seams


def initialize(
    tensor: int = 1,
    pipeline: int = 1,
    virtual_pipeline: int | None = None,
    expert: int = 1,
    expert_tensor: int | None = None,
    context: int = 1,
    seed: int = 1234,
) -> None:
    platform.init_distributed()
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        destroy()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        context_parallel_size=context,
        expert_model_parallel_size=expert,
        expert_tensor_parallel_size=expert_tensor,
    )
    set_seed(seed)


def set_seed(seed: int) -> None:
    """Megatron's seeding: distinct per PP stage, the model-parallel tracker per TP rank."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    from megatron_ext.training import features

    features.teardown()
    parallel_state.destroy_model_parallel()
    _destroy_subgroups()
    seams.reset_megatron_globals()


def _destroy_subgroups() -> None:
    """destroy_model_parallel forgets megatron's process groups but does not destroy them; each gloo
    group keeps its threads, so a process that runs many layouts would pile up thousands. Destroy
    every group but the default one (all ranks reach this point together)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    groups = [group for group in c10d._world.pg_map if group is not world and group is not None]
    for group in groups:
        dist.destroy_process_group(group)
    group = None  # noqa: F841 - the loop's last group is released with the others
    if dist.get_backend() == "gloo":
        _release_at_once(groups)


def _release_at_once(groups: list) -> None:
    """Let go of `groups` (the last references, where nothing else holds them), each from its own
    thread. A gloo group's destructor waits for its transport's event loop to tick once per connected
    pair (up to 10 ms each: gloo's tcp Loop::unregisterDescriptor), with the GIL released; one after
    the other that was 0.13 s per teardown of a 2-process world, at once 0.02 s (measured, 2-core
    CPU). Only gloo: other backends' groups are released one by one as before."""
    import threading

    holders = [[group] for group in groups]
    groups.clear()
    threads = [threading.Thread(target=holder.clear, name="release process group") for holder in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
