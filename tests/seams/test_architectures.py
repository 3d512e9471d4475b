"""What real model configs need of the local spec (megatron_ext/seams/architectures.py), against
references written from the formulas they implement."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.transformer import torch_norm
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.seams import architectures
from tests.dist import run_distributed


def _config(normalization: str) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization=normalization,
                             layernorm_zero_centered_gamma=True)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centred_norm_matches_transformer_engine_formula(normalization):
    config, eps = _config(normalization), 1e-5
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        torch_norm.WrappedTorchNorm(config=config, hidden_size=32, eps=eps)  # megatron's own refusal
    with architectures.ZERO_CENTRED_NORM.applied():
        norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=32, eps=eps)
        plain = torch_norm.WrappedTorchNorm(config=dataclasses.replace(config, layernorm_zero_centered_gamma=False),
                                            hidden_size=32, eps=eps)
    assert type(plain) in (torch.nn.LayerNorm, torch.nn.RMSNorm)  # the seam leaves other configs alone
    assert set(dict(norm.named_parameters())) == set(dict(plain.named_parameters()))  # checkpoint keys
    assert torch.equal(norm.weight, torch.zeros(32))  # gamma is stored zero-centred
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 32, generator=g)
    assert torch.equal(norm(x), plain(x))  # zero gamma = the plain norm's unit gamma, bit for bit
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g) * 0.1)
        if normalization == "LayerNorm":
            norm.bias.copy_(torch.randn(32, generator=g) * 0.1)
    gamma = norm.weight.detach()
    if normalization == "LayerNorm":  # y = (x - E[x]) / sqrt(Var[x] + eps) * (1 + gamma) + beta
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        ref = (x - mean) / torch.sqrt(var + eps) * (1 + gamma) + norm.bias.detach()
    else:  # y = x / sqrt(E[x^2] + eps) * (1 + gamma)
        ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + gamma)
    torch.testing.assert_close(norm(x), ref, rtol=0, atol=2e-6)
    norm(x).sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def test_latent_attention_matches_formula():
    [r] = run_distributed(1, "tests.seams.jobs:latent_attention_against_formula")
    assert r["refused_without_seam"]
    assert r["shape"] == (8, 2, 4 * 16)  # values and output of v_channels per head
    assert r["max_err"] < 1e-5, r
