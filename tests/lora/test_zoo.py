"""Every feature of the project with LoRA on, bit for bit against the same LoRA run without them:
the model zoo's pipeline cases (tests/training/zoo.py PP_CASES) under TP2 + SP x PP2 x VPP2 x EP2 with
adapters on every linear the architecture has and on the router, plain vs activation offload +
sync-free and zero-sync dispatchers (the experts' adapters as grouped GEMMs) + the overlapped 1F1B
(the adapters' collectives in its lanes), with the recipe's own recompute in both runs."""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed
from tests.training import zoo


@pytest.mark.parametrize("case", ["deepseek_r1"])
def test_lora_under_pp_vpp_trains_bitwise_with_every_feature_on(case):
    argvs = {"plain": zoo.pp_argv(case, False) + zoo.LORA, "features": zoo.pp_argv(case, True) + zoo.LORA}
    results = run_distributed(4, "tests.training.jobs_zoo:train_digests", argvs=argvs)
    losses = [h["lm loss"] for h in results[-1]["plain"]["history"]]
    assert len(losses) == 1 and all(math.isfinite(x) for x in losses)
    for rank, r in enumerate(results):
        a, b = r["plain"], r["features"]
        assert [repr((h["lm loss"], h["grad norm"])) for h in a["history"]] == \
            [repr((h["lm loss"], h["grad norm"])) for h in b["history"]], rank
        assert a["params"] == b["params"] and a["grads"] == b["grads"], rank
        trained = [k for k in a["grads"] if ".lora." in k]
        assert trained and len(trained) == len(a["grads"]), rank  # gradients: the adapters' only
        assert sum(v["offloaded"] for v in b["offloaded"].values()) > 0, rank


def test_lora_with_recompute_and_megatron_ep_overlap_bitwise():
    """tiny_moe EP2 (bf16, a shared expert) with adapters on every linear and the router and LoRA
    dropout on: full recompute, selective recompute (core attention and the MoE layer), megatron's own
    --overlap-moe-expert-parallel-comm (its combined-1F1B plan ran every iteration), and activation
    offload + the sync-free dispatcher + the overlapped 1F1B: each bit for bit the plain LoRA run
    (weights, gradients, losses after 2 iterations: the second runs the adapters with B moved)."""
    base = ["--recipe", "recipes/tiny_moe.yaml", "--expert-model-parallel-size", "2", "--bf16", "--train-iters", "2",
            "--lr-warmup-iters", "0", "--num-layers", "2", "--moe-shared-expert-intermediate-size", "32",
            "--lora-rank", "8",
            "--lora-dropout", "0.1", "--lora-target-modules", "all-linear"]
    offload = ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act",
               "router_fc2", "shared_experts", "--activation-offload-min-tensor-kb", "0"]
    variants = {
        "plain": [],
        "recompute-full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"],
        "recompute-selective": ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
        "megatron-ep-overlap": ["--overlap-moe-expert-parallel-comm"],
        "offload+sync-free+overlap-1f1b": offload + ["--moe-sync-free-dispatcher", "--overlap-tp-comm-1f1b"],
    }
    results = run_distributed(2, "tests.schedules.jobs:train_digests", base=base, variants=variants)
    for rank, per in enumerate(results):
        ref = per["plain"]
        assert ref["combined_1f1b_calls"] == 0 and per["megatron-ep-overlap"]["combined_1f1b_calls"] == 2
        assert [k for k in ref["grads"] if ".lora." not in k] == [] and ref["grads"], rank
        for name, r in per.items():
            assert r["params"] == ref["params"] and r["grads"] == ref["grads"], (name, rank)
            assert [h["lm loss"] for h in r["history"]] == [h["lm loss"] for h in ref["history"]], (name, rank)
        assert sum(v["offloaded"] for v in per["offload+sync-free+overlap-1f1b"]["offloaded"].values()) > 0
