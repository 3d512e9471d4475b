"""Seams of the architectures: what real model configs ask of megatron-core's local (plain torch) layer
spec that it lacks. Each is plain torch, on every platform (CUDA without transformer-engine too).

  local_latent_attention  multi-latent attention (MLA) on the local spec: MLASelfAttention builds its core
                          attention with ``k_channels`` / ``v_channels`` (transformer/multi_latent_attention.py:207),
                          which DotProductAttention does not take (transformer/dot_product_attention.py:42); the
                          local spec's core attention (models/backends.py:129, LocalSpecProvider.core_attention)
                          becomes a DotProductAttention that takes them: queries and keys of k_channels per head,
                          values and the output of v_channels per head.
                          Without --q-lora-rank, --qk-layernorm puts the query norm in front of linear_q_proj as a
                          fused norm+linear (transformer/mla_qk_norm_config.py:140, 233), which the local backend
                          lacks (models/backends.py:114 returns None) and its spec's standalone q_layernorm is
                          refused (mla_qk_norm_config.py:172): the local backend gets a norm+linear (torch's norm,
                          then ColumnParallelLinear), and the standalone query norm moves into it, as in the
                          transformer-engine spec.
  mla_q_proj_without_norm --mla-q-proj-without-norm: without --q-lora-rank, linear_q_proj is a plain linear on
                          the layer's normalised input, where megatron-core's resolver puts --qk-layernorm's query
                          norm into a fused norm+linear (transformer/mla_qk_norm_config.py:148); the KV latent
                          norm stays. DeepSeek-V2-Lite as transformers and DeepSeek's own code compute it.
  mla_shared_rope_key_grad  multi-latent attention under tensor parallelism: the column-parallel KV down
                          projection's output is gathered (transformer/multi_latent_attention.py:739) and its
                          shared rope key expanded to this rank's heads (:960); the gather's backward takes
                          this rank's slice of a gradient that holds only its own heads' part of the rope
                          key's (the latent's is reduced by linear_kv_up_proj). The rope key's columns of the
                          gradient are summed over the tensor-parallel group before the slice (the output is
                          marked in _qkv_down_projection, :662, and only that gather is replaced).
  llama3_rope_factors     --rope-scaling-low-freq-factor / --rope-scaling-high-freq-factor /
                          --rope-scaling-original-max-position-embeddings: megatron-core's llama-3 rope scaling
                          takes only the factor from its caller (models/common/embeddings/rotary_pos_embedding.py:84)
                          and keeps the others at Llama-3.1's 1 / 4 / 8192 (:92); this run's values replace them
                          (Llama-4-Scout: high frequency factor 1). The formula is megatron's own.
  zero_centred_norm       --apply-layernorm-1p (config.layernorm_zero_centered_gamma, Nemotron): torch's norms
                          refuse it (transformer/torch_norm.py:45). The norm stores gamma - 1 (initialised to 0)
                          and applies (1 + gamma), transformer-engine's zero_centered_gamma formula
                          (and megatron's own FusedLayerNorm, fusions/fused_layer_norm.py:133):
                              LayerNorm: y = (x - E[x]) / sqrt(Var[x] + eps) * (1 + gamma) + beta
                              RMSNorm:   y = x / sqrt(E[x^2] + eps) * (1 + gamma)
                          Checkpoint keys stay those of torch's norms (weight, bias).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.models import backends
from megatron.core.transformer import torch_norm
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp

from megatron_ext.patching import Patch, set_attr, undo_all


class LocalLatentAttention(DotProductAttention):
    """DotProductAttention whose key and value head sizes may differ from --kv-channels (MLA:
    k_channels = qk_head_dim + qk_pos_emb_head_dim, v_channels = v_head_dim). The attention math is
    DotProductAttention.forward's; only the sizes it derives from kv_channels change."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if k_channels is not None and softmax_scale is None:
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= max(1, layer_number)
        if v_channels is not None:
            self.hidden_size_per_attention_head = v_channels
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


class LocalNormLinear(ColumnParallelLinear):
    """A norm, then ColumnParallelLinear: the local backend's fused norm+linear (as transformer-engine's
    LayerNormColumnParallelLinear computes it). The norm is the local spec's (torch_norm.WrappedTorchNorm),
    so it follows --normalization, --norm-epsilon and sequence parallelism."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=input_size, eps=config.layernorm_epsilon)

    def forward(self, input_, *args, **kwargs):
        return super().forward(self.norm(input_), *args, **kwargs)


def _install_local_latent_attention():
    from megatron.core.transformer import mla_qk_norm_config

    resolver = mla_qk_norm_config.QKNormConfigResolver
    original_init = resolver.__init__

    def __init__(self, config, submodules):
        if config.q_lora_rank is None and config.qk_layernorm and config.transformer_impl == "local" \
                and submodules.q_layernorm not in (None, IdentityOp):
            # the query norm of a model without query LoRA is fused into linear_q_proj (built below)
            submodules = dataclasses.replace(submodules, q_layernorm=IdentityOp)
        original_init(self, config, submodules)

    return undo_all([
        set_attr(backends.LocalSpecProvider, "core_attention", lambda self: LocalLatentAttention),
        set_attr(backends.LocalSpecProvider, "column_parallel_layer_norm_linear", lambda self: LocalNormLinear),
        set_attr(resolver, "__init__", __init__),
    ])


def _install_mla_q_proj_without_norm():
    from megatron.core.transformer import mla_qk_norm_config

    resolver = mla_qk_norm_config.QKNormConfigResolver
    original = resolver._resolve_mla_qk_layernorm

    def _resolve_mla_qk_layernorm(self):
        resolved = original(self)
        if not self.has_q_lora:
            resolved["linear_q_proj"] = self.linear_impl
        return resolved

    return set_attr(resolver, "_resolve_mla_qk_layernorm", _resolve_mla_qk_layernorm)


class _GatherLatentAndSharedRopeKey(torch.autograd.Function):
    """megatron-core's gather of the column-parallel KV down projection's output (forward: all-gather
    the last dimension, backward: this rank's slice), with the gradient of the shared rope key (the
    last qk_pos_emb_head_dim columns) summed over the tensor-parallel group before the slice: every
    rank's attention heads use that key, so each rank holds only its heads' part of its gradient. The
    latent's gradient is already the same on every rank (linear_kv_up_proj's input reduces it)."""

    @staticmethod
    def forward(ctx, x, group, rope_dim):
        from megatron.core.tensor_parallel.mappings import _gather_along_last_dim

        ctx.group, ctx.rope_dim = group, rope_dim
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.tensor_parallel.mappings import _split_along_last_dim

        rope = grad[..., grad.shape[-1] - ctx.rope_dim:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad = torch.cat([grad[..., : grad.shape[-1] - ctx.rope_dim], rope], dim=-1)
        return _split_along_last_dim(grad, ctx.group), None, None


_ROPE_KEY_COLUMNS = "_megatron_ext_shared_rope_key_columns"  # set on the KV down projection's output


def _install_mla_shared_rope_key_grad():
    from megatron.core.tensor_parallel.mappings import get_tensor_model_parallel_group_if_none
    from megatron.core.transformer import multi_latent_attention as mla

    down, gather = mla.MLASelfAttention._qkv_down_projection, mla.gather_from_tensor_model_parallel_region

    def _qkv_down_projection(self, hidden_states):
        q, kv = down(self, hidden_states)
        if kv.size(-1) != self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim:  # sharded: gathered next
            setattr(kv, _ROPE_KEY_COLUMNS, self.config.qk_pos_emb_head_dim)
        return q, kv

    def gather_from_tensor_model_parallel_region(input_, group=None):
        rope_dim = getattr(input_, _ROPE_KEY_COLUMNS, None)
        if rope_dim is None:
            return gather(input_, group)
        return _GatherLatentAndSharedRopeKey.apply(input_, get_tensor_model_parallel_group_if_none(group), rope_dim)

    return undo_all([
        set_attr(mla.MLASelfAttention, "_qkv_down_projection", _qkv_down_projection),
        set_attr(mla, "gather_from_tensor_model_parallel_region", gather_from_tensor_model_parallel_region),
    ])


LLAMA3_ROPE: dict = {}  # this run's low / high frequency factors and original positions (for_run)


def _install_llama3_rope_factors():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    original = RotaryEmbedding._apply_scaling

    def _apply_scaling(self, freqs, factor=8, **_fixed):
        return original(self, freqs, factor=factor, **LLAMA3_ROPE)

    return set_attr(RotaryEmbedding, "_apply_scaling", _apply_scaling)


def _zero_centred(norm_cls):
    class ZeroCentred(norm_cls):
        """torch's norm storing gamma - 1 (transformer-engine's zero_centered_gamma)."""

        def reset_parameters(self) -> None:
            super().reset_parameters()
            if self.weight is not None:
                torch.nn.init.zeros_(self.weight)

        def forward(self, x):
            if isinstance(self, torch.nn.LayerNorm):
                return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)
            return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)

    ZeroCentred.__name__ = ZeroCentred.__qualname__ = f"ZeroCentred{norm_cls.__name__}"
    return ZeroCentred


ZERO_CENTRED = {cls: _zero_centred(cls) for cls in (torch.nn.LayerNorm, torch.nn.RMSNorm)}


def _install_zero_centred_norm():
    inner = torch_norm.WrappedTorchNorm.__new__  # the sequence-parallel seam's, when that is installed

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.layernorm_zero_centered_gamma:
            return inner(cls, config, hidden_size, eps, **kwargs)
        norm = inner(cls, dataclasses.replace(config, layernorm_zero_centered_gamma=False), hidden_size, eps, **kwargs)
        norm.__class__ = ZERO_CENTRED[type(norm)]
        norm.reset_parameters()
        return norm

    return set_attr(torch_norm.WrappedTorchNorm, "__new__", staticmethod(__new__))


LOCAL_LATENT_ATTENTION = Patch(
    "architectures.local_latent_attention",
    ["megatron/core/models/backends.py:129", "megatron/core/transformer/multi_latent_attention.py:207",
     "megatron/core/transformer/dot_product_attention.py:42", "megatron/core/models/backends.py:114",
     "megatron/core/transformer/mla_qk_norm_config.py:172"],
    "the local spec's DotProductAttention does not take MLA's k_channels / v_channels; without query LoRA "
    "its query norm has no fused norm+linear to go into",
    _install_local_latent_attention,
)
MLA_Q_PROJ_WITHOUT_NORM = Patch(
    "architectures.mla_q_proj_without_norm",
    ["megatron/core/transformer/mla_qk_norm_config.py:148"],
    "without query LoRA, --qk-layernorm puts a norm in front of linear_q_proj that DeepSeek-V2-Lite does not have",
    _install_mla_q_proj_without_norm,
)
MLA_SHARED_ROPE_KEY_GRAD = Patch(
    "architectures.mla_shared_rope_key_grad",
    ["megatron/core/transformer/multi_latent_attention.py:739",
     "megatron/core/transformer/multi_latent_attention.py:960",
     "megatron/core/transformer/multi_latent_attention.py:662"],
    "under tensor parallelism the shared rope key's gradient keeps only this rank's heads' part "
    "(the gather's backward takes this rank's slice of an unreduced gradient)",
    _install_mla_shared_rope_key_grad,
)
LLAMA3_ROPE_FACTORS = Patch(
    "architectures.llama3_rope_factors",
    ["megatron/core/models/common/embeddings/rotary_pos_embedding.py:84",
     "megatron/core/models/common/embeddings/rotary_pos_embedding.py:92"],
    "megatron-core's llama-3 rope scaling fixes the low / high frequency factors and original positions",
    _install_llama3_rope_factors,
)
ZERO_CENTRED_NORM = Patch(
    "architectures.zero_centred_norm",
    ["megatron/core/transformer/torch_norm.py:45"],
    "torch's LayerNorm/RMSNorm refuse --apply-layernorm-1p (zero-centred gamma)",
    _install_zero_centred_norm,
)
SEAMS = [LOCAL_LATENT_ATTENTION, MLA_Q_PROJ_WITHOUT_NORM, MLA_SHARED_ROPE_KEY_GRAD, LLAMA3_ROPE_FACTORS,
         ZERO_CENTRED_NORM]
# (flag dest, _apply_scaling's argument, the value megatron-core fixes): the flags (training/model.py),
# this seam and the Hugging Face import (hf/families.py) read this one table
LLAMA3_ROPE_FLAGS = (("rope_scaling_low_freq_factor", "low_freq_factor", 1.0),
                     ("rope_scaling_high_freq_factor", "high_freq_factor", 4.0),
                     ("rope_scaling_original_max_position_embeddings", "original_max_position_embeddings", 8192))


def for_run(args):
    local = args.transformer_impl == "local"
    out = []
    if local and args.multi_latent_attention:
        out.append(LOCAL_LATENT_ATTENTION)
    if args.mla_q_proj_without_norm:
        out.append(MLA_Q_PROJ_WITHOUT_NORM)
    if args.multi_latent_attention and args.tensor_model_parallel_size > 1:
        out.append(MLA_SHARED_ROPE_KEY_GRAD)
    given = {flag: vars(args)[flag] for flag, _, _ in LLAMA3_ROPE_FLAGS}
    if any(value is not None for value in given.values()):
        LLAMA3_ROPE.clear()
        LLAMA3_ROPE.update({key: default if given[flag] is None else given[flag]
                            for flag, key, default in LLAMA3_ROPE_FLAGS})
        out.append(LLAMA3_ROPE_FACTORS)
    if local and args.layernorm_zero_centered_gamma:
        out.append(ZERO_CENTRED_NORM)
    return out
