"""Seams of torch FSDP2 (--use-torch-fsdp2, megatron-core's TorchFullyShardedDataParallel).

Replaced for FSDP2 runs:
  dist_checkpointing/optimizer.py:35-42 (get_optim_param_to_id_map, called by its module-global
    name at :62) pairs the optimizer's parameters with the model's ShardedTensors by id() of
    to_local_if_dtensor(param), while the model side holds the DTensor's `_local_tensor`
    (core/utils.py:1020). In torch >= 2.13 DTensor.to_local() of a Parameter returns a fresh view
    (torch/distributed/tensor/_api.py, gh-166156), so no id matches and a torch_dist save stops
    with "Param id 0 does not match any model sharded param" (optimizer.py:145). The replacement
    keys a DTensor by its `_local_tensor`, the tensor the model's ShardedTensor holds.
"""
from __future__ import annotations

from megatron_ext.patching import Patch, set_attr


def _local(param):
    return getattr(param, "_local_tensor", param)


def _optim_param_to_id_map(optim_params_iter) -> dict:
    """megatron's get_optim_param_to_id_map, keyed by the DTensor's own local shard."""
    mapping = {}
    for i, param in enumerate(optim_params_iter):
        mapping.setdefault(id(_local(param)), i)
    return mapping


def _install_optimizer_param_ids():
    from megatron.core.dist_checkpointing import optimizer

    return set_attr(optimizer, "get_optim_param_to_id_map", _optim_param_to_id_map)


OPTIMIZER_PARAM_IDS = Patch(
    "fsdp2.optimizer_param_ids",
    ["megatron/core/dist_checkpointing/optimizer.py:39", "megatron/core/dist_checkpointing/optimizer.py:62"],
    "optimizer state is paired with the model's ShardedTensors by id() of each parameter's local "
    "shard; torch's DTensor.to_local() of a Parameter is a new view each call, the DTensor's "
    "_local_tensor is the tensor the model's ShardedTensor holds",
    _install_optimizer_param_ids,
)
SEAMS = [OPTIMIZER_PARAM_IDS]


def for_run(args) -> list:
    return [OPTIMIZER_PARAM_IDS] if getattr(args, "use_torch_fsdp2", False) else []
