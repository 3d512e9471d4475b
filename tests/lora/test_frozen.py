"""The base is frozen: no gradient, no gradient buffer, no optimizer state; the log line's bytes
show it. A LoRA run and a full run of the same model side by side (DP2, with DDP and with
Megatron-FSDP, everything sharded): the gradient and optimizer bytes of the LoRA run are its adapters'."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed

MODEL = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--train-iters", "1", "--lr-warmup-iters", "0",
         "--log-interval", "1", "--world-size", "2", "--bf16"]
LORA = ["--lora-rank", "4", "--lora-target-modules", "all-linear"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
        "fsdp_dtensor"]


@pytest.fixture(scope="module")
def states():
    argvs = {"full": MODEL, "lora": MODEL + LORA, "full-fsdp": MODEL + FSDP, "lora-fsdp": MODEL + LORA + FSDP}
    return run_distributed(2, "tests.lora.jobs:frozen_states", argvs=argvs)


def test_nothing_of_the_base_has_a_gradient_or_a_buffer(states):
    for r in states:
        lora = r["lora"]
        assert lora["adapter_numel"] > 0 and lora["trainable_not_adapter"] == [] and lora["base_with_grad"] == []
        assert lora["buffered"] == lora["adapter_names"]  # DDP's gradient buffers: the adapters, every one
        assert r["full"]["buffered"] and r["full"]["trainable_not_adapter"]


def test_gradient_and_optimizer_bytes_are_the_adapters(states):
    for r in states:
        lora, full = r["lora"], r["full"]
        n = lora["adapter_numel"]
        # bf16 parameters: fp32 gradient buffers (megatron accumulates in fp32), fp32 main copies and
        # Adam's two fp32 moments per adapter element
        assert lora["bytes"]["grad bytes"] == 4 * n, (lora["bytes"], n)
        assert lora["optimizer_state_numel"] == 2 * n and lora["bytes"]["optim bytes"] >= 8 * n
        assert lora["bytes"]["param bytes"] == 2 * (lora["base_numel"] + n) + 4 * n
        assert full["bytes"]["grad bytes"] == 4 * full["base_numel"]
        share = n / lora["base_numel"]  # the adapters' elements per base element (about 0.11 here)
        for kind in ("", "-fsdp"):  # LoRA's bytes / the full run's = that share, up to padding
            mine, theirs = r["lora" + kind]["bytes"], r["full" + kind]["bytes"]
            for key in ("grad bytes", "optim bytes"):
                assert abs(mine[key] / theirs[key] - share) <= 0.02 * share, (kind, key, mine, theirs, share)
