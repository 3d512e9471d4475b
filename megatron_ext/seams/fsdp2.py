"""Seams of torch FSDP2 (--use-torch-fsdp2, megatron-core's TorchFullyShardedDataParallel).

Replaced for FSDP2 runs:
  dist_checkpointing/optimizer.py:35-42 (get_optim_param_to_id_map, called by its module-global
    name at :62) pairs the optimizer's parameters with the model's ShardedTensors by id() of
    to_local_if_dtensor(param), while the model side holds the DTensor's `_local_tensor`
    (core/utils.py:1020). In torch >= 2.13 DTensor.to_local() of a Parameter returns a fresh view
    (torch/distributed/tensor/_api.py, gh-166156), so no id matches and a torch_dist save stops
    with "Param id 0 does not match any model sharded param" (optimizer.py:145). The replacement
    keys a DTensor by its `_local_tensor`, the tensor the model's ShardedTensor holds.
  transformer/moe/experts.py:1377-1418 (SequentialMLP.sharded_state_dict) sets every expert
    tensor's data-parallel replica id to the rank in the expert data-parallel group (:1415), over
    the 0 that make_tp_sharded_tensor_for_checkpoint gives FSDP2 shards (core/utils.py:1019: "every
    DP shard is a main replica"). Only rank 0's shard of each expert weight is then written and
    the save stops in validate_sharding_integrity ("Invalid access pattern for
    ShardedTensor(key='decoder.layers.mlp.experts.experts.linear_fc1.weight' ..."). The wrapper
    puts 0 back for the entries that hold an FSDP2 parameter's local shard.
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


def _fsdp2_expert_replicas(original):
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = original(self, prefix, sharded_offsets, metadata)
        shards = {id(p._local_tensor) for p in self.parameters()
                  if getattr(p, "is_torch_fsdp2_param", False) and hasattr(p, "_local_tensor")}
        for entry in state.values():
            if id(getattr(entry, "data", None)) in shards:
                entry.replica_id = (*entry.replica_id[:2], 0)
        return state

    return sharded_state_dict


def _install_expert_replicas():
    from megatron.core.transformer.moe.experts import SequentialMLP

    return set_attr(SequentialMLP, "sharded_state_dict", _fsdp2_expert_replicas(SequentialMLP.sharded_state_dict))


EXPERT_REPLICAS = Patch(
    "fsdp2.expert_replicas",
    ["megatron/core/transformer/moe/experts.py:1415", "megatron/core/utils.py:1019"],
    "an FSDP2 shard of an expert weight is the only copy of its rows: its data-parallel replica id "
    "must stay 0 (as for every other FSDP2 parameter), not the rank, or only rank 0's shard is saved",
    _install_expert_replicas,
)
SEAMS = [OPTIMIZER_PARAM_IDS, EXPERT_REPLICAS]


def for_run(args) -> list:
    return [OPTIMIZER_PARAM_IDS, EXPERT_REPLICAS] if args.use_torch_fsdp2 else []
