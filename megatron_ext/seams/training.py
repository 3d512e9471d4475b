"""Seams of the substrate: process-wide state megatron-core keeps between runs, and torch norms under
sequence parallelism."""
from __future__ import annotations

import dataclasses

import torch

from megatron.core import num_microbatches_calculator as nmc
from megatron.core import parallel_state
from megatron.core.transformer import torch_norm
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

from megatron_ext.patching import Patch, set_attr
from megatron_ext.seams.moe import reset_moe_aux_loss_scale


def unwrapped(chunk):
    """The model inside megatron-core's wrappers: DDP, Megatron-FSDP and Float16Module keep it in
    `.module` (distributed/data_parallel_base.py, transformer/module.py Float16Module)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def reset_megatron_globals() -> None:
    """Cleared at teardown so a persistent worker can run another layout (nothing is replaced):
    the global memory buffer (megatron/core/utils.py:_GLOBAL_MEMORY_BUFFER, via
    parallel_state.destroy_global_memory_buffer) and the microbatch calculator
    (megatron/core/num_microbatches_calculator.py:_GLOBAL_NUM_MICROBATCHES_CALCULATOR), and the
    MoE aux-loss scale a previous run's schedule set (moe/moe_utils.py MoEAuxLossAutoScaler), and the
    MoE metrics tracker, whose per-layer entries keep the previous model's layer count
    (moe/moe_logging.py:49; a deeper model then indexes past them at :125), and the process groups
    parallel_state.destroy_model_parallel (parallel_state.py:2506) leaves referenced
    (parallel_state.py:129, 131, 146-147), which keeps each gloo group's threads alive, and the
    lru_cache on RotaryEmbedding.forward (models/common/embeddings/rotary_pos_embedding.py:177,
    yarn_rotary_pos_embedding.py:159), keyed by the module, so it keeps the last 32 models' rotary
    embeddings and with them their context-parallel groups, and the multi-token-prediction loss
    tracker (transformer/multi_token_prediction.py:372), sized by the previous run's MTP layer count
    and holding its process groups."""
    from megatron.core import config as megatron_config
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    parallel_state.destroy_global_memory_buffer()
    megatron_config.set_experimental_flag(False)  # --enable-experimental is the run's
    nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    # destroy_model_parallel forgets these; a reference left here keeps a destroyed group's threads
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    parallel_state._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    parallel_state._HYBRID_DP_CP_GROUPS = {}
    # the cache key is the module itself: it keeps finished runs' modules (and their cp_group) alive
    rotary_pos_embedding.RotaryEmbedding.forward.cache_clear()
    yarn_rotary_pos_embedding.YarnRotaryEmbedding.forward.cache_clear()
    reset_moe_aux_loss_scale()
    destroy_moe_metrics_tracker()
    MTPLossLoggingHelper.tracker.clear()


def _install_torch_norm_sequence_parallel():
    """megatron/core/transformer/torch_norm.py:50 (WrappedTorchNorm.__new__, the local spec's norm
    without apex, and its only RMSNorm) asserts `not config.sequence_parallel`, which blocks TP+SP and
    TP+MoE on the local spec on every platform. torch's norm is correct under SP once its weights carry
    the `sequence_parallel` attribute megatron's own norms set: finalize_model_grads then all-reduces
    their grads over the TP group (megatron/core/distributed/finalize_model_grads.py:452)."""
    original_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, eps, **kwargs)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", True)
        return norm

    return set_attr(torch_norm.WrappedTorchNorm, "__new__", staticmethod(__new__))


# For the process, not a run: on CPU the platform's shim registry holds it (cpu_shims
# "torch_norm_sequence_parallel", always on); on CUDA the model builder applies it when the local
# spec runs with sequence parallelism (training/model.py install_seams).
TORCH_NORM_SEQUENCE_PARALLEL = Patch(
    "training.torch_norm_sequence_parallel",
    ["megatron/core/transformer/torch_norm.py:50", "megatron/core/distributed/finalize_model_grads.py:452"],
    "torch LayerNorm/RMSNorm refused under sequence parallel without apex/TE (blocks TP+SP, TP+MoE)",
    _install_torch_norm_sequence_parallel,
)
SEAMS = [TORCH_NORM_SEQUENCE_PARALLEL]
