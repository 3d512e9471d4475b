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


# a DeepSeek-V3-style multi-latent attention, scaled down (tests/training/zoo.py's)
MLA = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--layout-invariant-init", "--num-layers", "2",
       "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--no-rope-fusion",
       "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm",
       "--mscale", "1.0", "--mscale-all-dim", "1.0"]
KV_DOWN = "decoder.layers.self_attention.linear_kv_down_proj.weight"


def _worst(got: dict, ref: dict) -> float:
    """The largest error relative to its own block's scale: every parameter, and the shared rope key's
    rows of the KV down projection apart (their gradient is far smaller than the latent's)."""
    import numpy as np

    blocks = [(k, slice(None)) for k in ref] + [(KV_DOWN, np.s_[..., 32:, :])]
    return max(float(np.abs(got[k][s] - ref[k][s]).max() / np.abs(ref[k][s]).max()) for k, s in blocks)


def test_latent_attention_gradients_equal_one_process_under_tensor_parallelism():
    """Every gradient of a multi-latent attention model on TP2 and TP2+SP equals one process's (fp32
    summation order apart); without architectures.mla_shared_rope_key_grad the shared rope key's rows
    keep half their gradient (megatron-core's gather at multi_latent_attention.py:739)."""
    ref = run_distributed(1, "tests.seams.jobs:global_gradients", argv=MLA + ["--world-size", "1"])[0]
    for extra in (["--tensor-model-parallel-size", "2"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]):
        got = run_distributed(2, "tests.seams.jobs:global_gradients", argv=MLA + extra + ["--world-size", "2"])[0]
        assert set(got) == set(ref)
        assert _worst(got, ref) < 1e-5, extra
    broken = run_distributed(2, "tests.seams.jobs:global_gradients", without="MLA_SHARED_ROPE_KEY_GRAD",
                             argv=MLA + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "2"])[0]
    assert _worst(broken, ref) > 0.1
