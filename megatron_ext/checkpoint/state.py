"""What a checkpoint holds beside the tensors, shared by both formats (resuming.py, saving.py: torch_dist,
fsdp.py: Megatron-FSDP's fsdp_dtensor): the parallel layout it was saved in, the
sharding metadata megatron-core's sharded state dicts take, the RNG states, the common state
(iteration, consumed samples, LR schedule)."""
from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel


def optimizer_has_state(args) -> bool:
    """Does the run's optimizer hold state a checkpoint saves and loads? Not under --freeze-all-layers:
    no parameter trains, so megatron's get_megatron_optimizer builds a stub optimizer with no torch
    optimizer inside (its state_dict would fail, optimizer/optimizer.py FP32Optimizer.state_dict). Such
    a run saves the model, schedule and RNG (as with --no-save-optim) and loads none into the stub."""
    return not args.freeze_all_layers


def layout(args) -> dict:
    """The parallel layout of this run; a checkpoint saved in another one is resharded on load and
    its RNG states are not restored."""
    return {
        "world_size": torch.distributed.get_world_size(),
        "tensor": args.tensor_model_parallel_size,
        "pipeline": args.pipeline_model_parallel_size,
        "virtual_pipeline": args.virtual_pipeline_model_parallel_size,
        "expert": args.expert_model_parallel_size,
        "expert_tensor": args.expert_tensor_parallel_size,
        "context": args.context_parallel_size,
    }


def sharding_metadata(args) -> dict:
    """As megatron/training/checkpointing.py:468 (_build_sharded_state_dict_metadata) builds it.
    The distributed optimizer is saved `dp_reshardable` (DP changes only) unless
    --dist-ckpt-optim-fully-reshardable; megatron-core's own default, `fully_sharded_model_space`,
    fails with this optimizer's torch-Adam path (mapping.py:134 "flattened_range is not supported")."""
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if args.ckpt_format == "fsdp_dtensor":  # Megatron-FSDP's optimizer: per-parameter DTensors
        metadata["distrib_optim_sharding_type"] = "fsdp_dtensor"
    elif args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = getattr(
                args, "distrib_optim_fully_reshardable_mem_efficient", False
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def rng_state() -> dict:
    """This rank's RNG states: Python, NumPy, torch (CPU and CUDA), the model-parallel tracker."""
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def common_state(args, scheduler, iteration: int, *, with_rng: bool) -> dict:
    """What every checkpoint format records beside the tensors: where the run is, its layout and
    LR schedule, whether RNG states were saved."""
    return {
        "iteration": iteration,
        "consumed_samples": iteration * args.global_batch_size,
        "layout": layout(args),
        "scheduler": scheduler.state_dict(),
        "has_rng": with_rng,
    }


def sharded_tensors(state):
    """Every ShardedTensor of a megatron-core sharded state dict (factories built, nesting walked)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in state.values():
        if isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, ShardedTensorFactory):
            built = value.build()
            yield from sharded_tensors(built if isinstance(built, dict) else {i: t for i, t in enumerate(built)})
        elif isinstance(value, dict):
            yield from sharded_tensors(value)
        elif isinstance(value, (list, tuple)):
            yield from sharded_tensors(dict(enumerate(value)))
