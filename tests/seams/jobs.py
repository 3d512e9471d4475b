"""Job functions for the seam tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import math

import torch


def latent_attention_against_formula() -> dict:
    """MLA's core attention on the local spec (seams.architectures.LocalLatentAttention), against
    causal softmax attention written out from its definition, with key and value head sizes that
    differ from each other and from --kv-channels; and megatron's own DotProductAttention refusing
    them without the seam."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.seams import architectures
    from megatron_ext.training import parallel

    parallel.initialize()
    try:
        heads, dk, dv, sq, b = 4, 24, 16, 8, 2
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=heads, kv_channels=16,
                                   attention_dropout=0.0, masked_softmax_fusion=False)
        kwargs = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                      softmax_scale=0.125, k_channels=dk, v_channels=dv)
        try:
            LocalSpecProvider().core_attention()(**kwargs)
            refused = False
        except TypeError:
            refused = True
        with architectures.LOCAL_LATENT_ATTENTION.applied():
            attention = LocalSpecProvider().core_attention()(**kwargs)
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(sq, b, heads, dk, generator=g) for _ in range(2))
        v = torch.randn(sq, b, heads, dv, generator=g)
        mask = torch.ones(sq, sq, dtype=torch.bool).triu(1)[None, None]
        out = attention(q, k, v, mask)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * 0.125
        probs = scores.masked_fill(mask, -math.inf).softmax(-1)
        ref = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(sq, b, heads * dv)
        return dict(refused_without_seam=refused, shape=tuple(out.shape),
                    max_err=(out - ref).abs().max().item())
    finally:
        parallel.destroy()
