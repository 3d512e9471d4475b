"""The base is frozen: no gradient, no gradient buffer, no optimizer state; the log line's bytes
show it. A LoRA run and a full run of the same model side by side (DP2 x EP2, with DDP and with
Megatron-FSDP, everything sharded): the gradient and optimizer bytes of the LoRA run are its adapters'.
The planner counts the same adapters and gives the frozen base no gradient or optimizer bytes."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed

MODEL = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--train-iters", "1", "--lr-warmup-iters", "0",
         "--log-interval", "1", "--world-size", "2", "--bf16", "--expert-model-parallel-size", "2"]
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
        def held(numel, routed):  # elements a rank holds: Megatron-FSDP shards the dense ones over DP2
            return {"": numel, "-fsdp": (numel - routed) / 2 + routed}

        adapters = held(n, lora["routed_adapter_numel"])
        base = held(lora["base_numel"], lora["routed_base_numel"])
        for kind in ("", "-fsdp"):  # LoRA's bytes / the full run's = the adapters' share, up to padding
            share = adapters[kind] / base[kind]  # about 0.1 here
            mine, theirs = r["lora" + kind]["bytes"], r["full" + kind]["bytes"]
            for key in ("grad bytes", "optim bytes"):
                assert abs(mine[key] / theirs[key] - share) <= 0.02 * share, (kind, key, mine, theirs, share)


def test_the_planner_counts_the_adapters_and_freezes_the_base(states):
    """megatron_ext.lora.adapter_elements (the planner's count, from the flags) equals the adapters
    the run built on each rank; the planner's model state of that stage: the base's parameters, the
    adapters' gradients and optimizer state only."""
    from types import SimpleNamespace

    import arguments
    from megatron_ext import lora
    from megatron_ext.planner import memory

    args = arguments.parse(MODEL + LORA + ["--dry-run"], exit_on_dry_run=False)
    per_layer = lora.adapter_elements(args)
    assert per_layer["moe"][1] > 0 and 0 < per_layer["dense"][0] < per_layer["moe"][0]  # + the router's
    kinds = ["moe", "moe"]  # tiny_moe: every layer an MoE layer
    counted = sum(sum(per_layer[k]) for k in kinds)
    measured = states[0]["lora"]
    assert counted == measured["adapter_numel"]
    base_bytes = 2.0 * measured["base_numel"]
    scaled = SimpleNamespace(params_dense={"layer1": base_bytes, "embedding": 0.0, "head": 0.0},
                             params_expert={"layer1": 0.0, "embedding": 0.0, "head": 0.0}, gemm_weights={},
                             kind=lambda kind: "layer1")
    layout = memory.Layout.from_args(args)
    comps = [[("layer", "moe")] * 2]
    state = memory.model_state(args, scaled, layout, comps, 0)
    full = memory.model_state(arguments.parse(MODEL + ["--dry-run"], exit_on_dry_run=False), scaled, layout, comps, 0)
    assert state["gradients"] == 4 * counted and state["optimizer"] == 12 * counted  # fp32 grads, main copy, moments
    assert state["parameters"] == 2 * base_bytes + 2 * counted
    assert full["gradients"] == 4 * 2 * base_bytes / 2 and full["optimizer"] > 10 * state["optimizer"]
