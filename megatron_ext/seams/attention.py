"""Seam of the attention capability (megatron_ext/attention/): the local spec's core attention through
torch's kernels.

  torch_attention   the local spec's core attention (models/backends.py:129, LocalSpecProvider.core_attention,
                    read by every local layer spec of models/gpt/gpt_layer_specs.py and the MTP block)
                    becomes TorchCoreAttention: megatron-core's DotProductAttention
                    (transformer/dot_product_attention.py:42) as this project builds it for multi-latent
                    attention (seams/architectures.py LocalLatentAttention: k_channels / v_channels), whose
                    forward (:142) computes through megatron_ext.attention.kernels.attend instead of
                    baddbmm -> FusedScaleMaskSoftmax -> dropout -> bmm. Everything __init__ sets is read
                    as megatron set it: softmax_scale (times layer_number under
                    --apply-query-key-layer-scaling, which divided it by that, :91, and the softmax
                    multiplied it back, fusions/fused_softmax.py:317), the layer's sliding window
                    (scale_mask_softmax.window_size, :94-99), attention_dropout (:114) drawn inside the
                    model-parallel RNG tracker's fork unless sequence parallel (:214-219), the sinks
                    (softmax_offset, :118-138: zeros for off-by-one, a parameter for learnable, kept under
                    the same checkpoint key by its sharded_state_dict, :253). Queries, keys and values
                    arrive [s, b, heads (or groups), d] as megatron passes them; the output leaves
                    [s, b, heads x dv] as DotProductAttention's (:245-249). Packed sequences (THD) and an
                    attention bias stay refused as DotProductAttention refuses them (:153-157).

  te_environment    megatron-core's LanguageModule writes transformer-engine's backend switches into the
                    process environment (NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN, and
                    asserts any value already there matches, models/common/language_module/
                    language_module.py:108-153, called at :49) for every model, the local spec's too,
                    which reads none of them. A process that builds local-spec models with two
                    backends (the planner tracing a run, a test worker, a conversion after training)
                    would assert at the second. With the local spec the switches are left alone.

It sits above the capability packages (beside registry.py): it binds megatron-core's attention to the
attention package's kernels.
"""
from __future__ import annotations

import contextlib
import copy
import functools

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models import backends
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.attention import context_parallel, kernels
from megatron_ext.patching import Patch, set_attr
from megatron_ext.seams.architectures import LocalLatentAttention


class TorchCoreAttention(LocalLatentAttention):
    """megatron-core's DotProductAttention (k_channels / v_channels as multi-latent attention gives them)
    computed by torch's scaled_dot_product_attention / flex_attention: nothing of size s x s is kept for
    backward (queries, keys, values, the output and the log-sum-exp are). Under context parallelism
    (this rank holds megatron's load-balanced share of the sequence) the layer's --cp-comm-type (one, or
    this layer's of a per-layer list, as megatron's TransformerLayer passes it) computes it over the CP
    group (megatron_ext.attention.context_parallel); DotProductAttention's assert of one CP rank (:57)
    is what that replaces."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        one_rank = config
        if config.context_parallel_size > 1:
            one_rank = copy.copy(config)
            one_rank.context_parallel_size = 1
        super().__init__(one_rank, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, k_channels=k_channels, v_channels=v_channels,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        if cp_comm_type is None:  # megatron's TransformerLayer passes it under CP only (:361); its choice
            given = config.cp_comm_type
            cp_comm_type = given[layer_number - 1] if isinstance(given, list) else given
        self.layer_cp_comm_type = cp_comm_type or "p2p"  # megatron's default
        self.cp_comm_type = self.layer_cp_comm_type if config.context_parallel_size > 1 else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None, (
            "Packed sequence is not supported by DotProductAttention. Please use TEDotProductAttention instead.")
        assert attention_bias is None, "Attention bias is not supported for DotProductAttention."
        # attn_mask_type is not used (as in DotProductAttention): the layer's own
        layer_scaling = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        dropout_p = self.attention_dropout.p if self.training else 0.0
        fork = tensor_parallel.get_cuda_rng_tracker().fork() \
            if dropout_p > 0.0 and not self.config.sequence_parallel else contextlib.nullcontext()
        sq, b = query.shape[:2]
        attend = kernels.attend
        simulated = context_parallel.simulated_group()  # the planner's trace of one CP rank
        if self.cp_comm_type is not None:
            attend = functools.partial(context_parallel.attend, self.cp_comm_type,
                                       group=parallel_state.get_context_parallel_group())
        elif simulated is not None:
            attend = functools.partial(context_parallel.attend, self.layer_cp_comm_type, group=simulated)
        with fork:
            out = attend(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                scale=self.softmax_scale * layer_scaling, causal=self.attn_mask_type == AttnMaskType.causal,
                mask=attention_mask, window=self.scale_mask_softmax.window_size, sink=self.softmax_offset,
                dropout_p=dropout_p)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [b, heads, s, dv] -> [s, b, heads x dv]


def _install_te_environment():
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule._set_attention_backend

    def _set_attention_backend(self):
        if getattr(self.config, "transformer_impl", "transformer_engine") != "local":
            original(self)

    return set_attr(LanguageModule, "_set_attention_backend", _set_attention_backend)


def _install_torch_attention():
    return set_attr(backends.LocalSpecProvider, "core_attention", lambda self: TorchCoreAttention)


TORCH_ATTENTION = Patch(
    "attention.torch_attention",
    ["megatron/core/models/backends.py:129", "megatron/core/transformer/dot_product_attention.py:57",
     "megatron/core/transformer/dot_product_attention.py:142"],
    "the local spec's core attention materialises the s x s probabilities and keeps them for backward; "
    "torch's scaled_dot_product_attention keeps O(s x hidden)",
    _install_torch_attention,
)
TE_ENVIRONMENT = Patch(
    "attention.te_environment",
    ["megatron/core/models/common/language_module/language_module.py:49",
     "megatron/core/models/common/language_module/language_module.py:108"],
    "every model writes (and asserts) transformer-engine's attention switches in the process environment, "
    "the local spec's too, which reads none: a second local model with another --attention-backend asserts",
    _install_te_environment,
)
SEAMS = (TORCH_ATTENTION, TE_ENVIRONMENT)


def for_run(args) -> tuple:
    """The local spec: its models leave transformer-engine's switches alone; --attention-backend auto /
    flash: torch's attention (the choice megatron_ext.attention recorded as ``args.attention_kernel``
    before megatron validated)."""
    if getattr(args, "transformer_impl", "local") != "local":
        return ()
    # arguments not parsed here carry no choice: megatron's default, --attention-backend auto
    kernel = getattr(args, "attention_kernel", "sdpa")
    return (TE_ENVIRONMENT, TORCH_ATTENTION) if kernel == "sdpa" else (TE_ENVIRONMENT,)
