"""Seams of LoRA adapters (megatron_ext/lora/).

Nothing of megatron-core is replaced globally. Per instance, on the linears a run targets (after the
model is built, before the data-parallel wrapper; the instances die with the model):
  ColumnParallelLinear.forward     tensor_parallel/layers.py:1100 (input copied / gathered at :1139-1147,
                                   the product at :1168, gather_output at :1189)
  RowParallelLinear.forward        tensor_parallel/layers.py:1430 (the reduction after the product at
                                   :1472-1480: none under explicit_expert_comm, reduce-scatter under
                                   sequence parallelism, all-reduce otherwise)
    -> an instance attribute shadowing the class's forward: the class's own forward, then the adapter
       term added to its output (megatron_ext.lora.adapters). The module stays the same object, so
       hooks that find it by attribute (activation offload, the planner's trace) still see it, and
       the adapter's saved tensors are saved inside its forward.
  ColumnParallelLinear.sharded_state_dict  tensor_parallel/layers.py:1217
  RowParallelLinear.sharded_state_dict     tensor_parallel/layers.py:1496
    -> both call make_sharded_tensors_for_checkpoint (transformer/utils.py:95) on the module's whole
       state dict with only "weight" / "bias" sharded, which would save a sharded adapter factor as
       replicated: the class's own dict, its adapter entries replaced by the adapter's own.
  TopKRouter.gating                transformer/moe/router.py:87 (called from TopKRouter.forward)
    -> the class's gating, plus the adapter term, when the router is a LoRA target.
  GPTModel.embedding (LanguageModelEmbedding, models/gpt/gpt_model.py:168, called at :345) ->
    a forward hook marking its output as needing a gradient, where megatron needs one and, with the
    embedding frozen, nothing before the first adapter has one: under recompute (CheckpointFunction,
    tensor_parallel/random.py:581, returns an output that needs a gradient only if an input does) and
    in the combined-1F1B plan (its embedding node runs a backward, model_chunk_schedule_plan.py:609).
Read, never written: ColumnParallelLinear/RowParallelLinear .tp_group (layers.py:953/1314),
  .sequence_parallel (:1058, :1313), .explicit_expert_comm (:960, :1326; set on a shared expert's
  linears by --moe-shared-expert-overlap, transformer/moe/shared_experts.py:166-175), .gather_output,
  .input_is_parallel; the weights' "allreduce" attribute (:1017, :1383: expert parameters are reduced
  over the expert data-parallel group by DDP, distributed/distributed_data_parallel.py:624).
Reused unchanged: tensor_parallel.mappings copy_to_tensor_model_parallel_region (:492),
  reduce_from_tensor_model_parallel_region (:498), gather_from_sequence_parallel_region (:522),
  reduce_scatter_to_sequence_parallel_region (:536) with the linear's own group (the expert-TP group for
  experts), so the 1F1B overlap's lanes route the adapters' collectives as they route the base's
  (seams/schedules.py wraps torch.distributed and mappings' gather / reduce-scatter);
  linear_with_grad_accumulation_and_async_allreduce (layers.py:756) for every adapter product (the
  products megatron's own linear computes, so the grouped experts reproduce them bit for bit);
  make_sharded_tensors_for_checkpoint (transformer/utils.py:95), apply_swiglu_sharded_factory
  (transformer/mlp.py:425) for the adapters' checkpoint entries.
"""
from __future__ import annotations

from typing import Callable


def adapt_linear(linear, forward: Callable, sharded_state_dict: Callable) -> None:
    """Shadow ``linear``'s forward and sharded_state_dict with ``forward(original, *a, **k)`` and
    ``sharded_state_dict(original, prefix, sharded_offsets, metadata)``, where ``original`` is the
    class's own bound method. ``restore_linear`` undoes it."""
    cls = type(linear)
    base_forward = cls.forward.__get__(linear, cls)
    base_sharded = cls.sharded_state_dict.__get__(linear, cls)

    def adapted_forward(*args, **kwargs):
        return forward(base_forward, *args, **kwargs)

    def adapted_sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        return sharded_state_dict(base_sharded, prefix, sharded_offsets, metadata)

    linear.forward = adapted_forward
    linear.sharded_state_dict = adapted_sharded_state_dict


def restore_linear(linear) -> None:
    for name in ("forward", "sharded_state_dict"):
        linear.__dict__.pop(name, None)


def adapt_router(router, gating: Callable) -> None:
    """Shadow ``router.gating`` (transformer/moe/router.py:87) with ``gating(original, input)``."""
    cls = type(router)
    base = cls.gating.__get__(router, cls)
    router.gating = lambda input: gating(base, input)


def restore_router(router) -> None:
    router.__dict__.pop("gating", None)


def embedding_output_needs_grad(model) -> list:
    """Forward hooks on the GPT model's input embedding (models/gpt/gpt_model.py:168) that mark its
    output as needing a gradient; returns the hook handles (empty when this chunk has none)."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return []

    def hook(_module, _inputs, output):
        if not output.requires_grad:
            output.requires_grad_(True)
        return output

    return [embedding.register_forward_hook(hook)]
