"""Attention that never crosses a packed row's conversations.

On the transformer-engine spec, pretrain_gpt.py's way: the micro-batch flattened into one row
(megatron.core.utils.flatten_batch_for_packed_sequences) and ``PackedSeqParams(qkv_format="thd")``
with its cu_seqlens; rotary positions restart per conversation there.

On the local spec (CPU, and GPUs without transformer-engine), whose DotProductAttention refuses packed
sequences (transformer/dot_product_attention.py:153): an explicit attention mask, True where a query
may not see a key, causal inside each conversation (and inside the padding) and closed between them.
Positions restart in ``position_ids``; rotary embeddings are relative (the score of query i and key j
depends on i - j), so a conversation at an offset in the row scores as it does alone. The mask is
[micro-batch, 1, S, S] booleans, built on the device from the row's segment boundaries. It carries
the segment ids it was made from (megatron_ext.attention.kernels.mark_documents): where the local
spec's core attention is torch's (--attention-backend auto / flash) on CUDA, flex_attention builds its
block mask from them (a document mask); elsewhere the mask itself is what every kernel reads (torch
SDPA's, megatron's unfused softmax).
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import flatten_batch_for_packed_sequences, get_attr_wrapped_model

from megatron_ext.attention.kernels import mark_documents

PACKED_KEYS = ("cu_seqlens", "max_seqlen")


def uses_thd(model) -> bool:
    return get_attr_wrapped_model(model, "config").transformer_impl == "transformer_engine"


def segment_ids(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """[b, S]: which segment (conversation, or the padding) each position of each row is in."""
    positions = torch.arange(seq_length, device=cu_seqlens.device).expand(cu_seqlens.shape[0], -1).contiguous()
    return torch.searchsorted(cu_seqlens.contiguous(), positions.to(cu_seqlens.dtype), right=True) - 1


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, S, S] bool, True = masked: another segment, or a later position (carrying ``segments``)."""
    length = segments.shape[1]
    later = torch.ones(length, length, dtype=torch.bool, device=segments.device).triu(1)
    return mark_documents((segments[:, None, :, None] != segments[:, None, None, :]) | later, segments)


def packed_inputs(batch: dict, model, device) -> tuple[dict, dict]:
    """A packed micro-batch (sft/packing.py's keys, on the host) -> (the batch on `device` with its
    attention mask, {} ) on the local spec, or (the batch flattened to one row on `device`,
    {"packed_seq_params": ...}) on the transformer-engine spec."""
    if uses_thd(model):
        flat = flatten_batch_for_packed_sequences(dict(batch))
        cu_seqlens = flat.pop("cu_seqlens").view(-1).to(device)
        longest = int(flat.pop("max_seqlen").max())  # a host value: read before the batch moves
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=longest, max_seqlen_kv=longest)
        return {k: v.to(device) for k, v in flat.items()}, {"packed_seq_params": params}
    out = {k: v.to(device) for k, v in batch.items() if k not in PACKED_KEYS}
    cu_seqlens = batch["cu_seqlens"].to(device)
    out["attention_mask"] = block_causal_mask(segment_ids(cu_seqlens, out["tokens"].shape[1]))
    return out, {}
