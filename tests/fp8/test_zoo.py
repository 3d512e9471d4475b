"""The model zoo (tests/training/zoo.py) trains in FP8 on its layout (TP2 + SP, EP2 for MoE): every
architecture's two iterations with FP8 products (--fp8-format e4m3 --fp8-recipe tensorwise; float32
weights) against the same run without, on the same data. Multi-latent attention's latent projections
get ranks FP8 takes (both dimensions of a product divisible by 16 on a rank): query rank 64, key-value
rank 48, rope head size 16 (DeepSeek-V3's are 1536, 512 and 64). The MoE architectures again with the
zero-sync dropless layer, whose grouped experts run torchao's MoE float8 recipe, and with every feature on."""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed
from tests.training import zoo

FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
FP8_LATENT_RANKS = ["--q-lora-rank", "64", "--kv-lora-rank", "48", "--qk-pos-emb-head-dim", "16"]
FP8_MOVES = 1e-6  # the smallest relative change FP8 made to a loss here: 1.6e-5 (deepseek_v2_lite)


ZERO_SYNC = ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_architecture_trains_in_fp8(name):
    _trains_in_fp8(zoo.plain_argv(name))


@pytest.mark.parametrize("name", [n for n, case in zoo.ZOO.items() if case["moe"]])
def test_moe_architecture_trains_in_fp8_with_the_zero_sync_layer(name):
    """And with every feature on (offload of every module, the grouped experts' included, and the
    1F1B overlap): the same FP8 run bit for bit, every hooked module moved."""
    featured = zoo.zero_sync_argv(name) + FP8 + _latent_ranks(zoo.zero_sync_argv(name))
    runs = _trains_in_fp8(zoo.plain_argv(name) + ZERO_SYNC, extra={"fp8 featured": featured})
    for rank, r in enumerate(runs):
        plain, on = r["fp8"], r["fp8 featured"]
        assert [(x["lm loss"], x["grad norm"]) for x in plain["history"]] == \
            [(x["lm loss"], x["grad norm"]) for x in on["history"]], (rank, plain["history"], on["history"])
        assert plain["params"] == on["params"] and plain["grads"] == on["grads"], rank
        hooked = on["offloaded"]
        assert {key.split("/")[0] for key in hooked} == set(zoo.offload_modules(name)), sorted(hooked)
        assert not [k for k, v in hooked.items() if v["saved"] > 0 and v["offloaded"] == 0], sorted(hooked)
        assert [k for k, v in hooked.items() if ".grouped_experts.linear_fc" in k and v["offloaded"]], sorted(hooked)


def _latent_ranks(argv: list) -> list:
    return FP8_LATENT_RANKS if "--multi-latent-attention" in argv else []


def _trains_in_fp8(base: list, extra: dict | None = None) -> list:
    base = base + _latent_ranks(base)
    runs = run_distributed(2, "tests.training.jobs_zoo:train_digests",
                           argvs={"high": base, "fp8": base + FP8, **(extra or {})})
    high, fp8 = ([r["lm loss"] for r in runs[0][k]["history"]] for k in ("high", "fp8"))
    assert len(fp8) == 2 and all(math.isfinite(x) for x in fp8), fp8
    moved = max(abs(a - b) / abs(a) for a, b in zip(high, fp8))
    assert FP8_MOVES < moved < 1e-2, (high, fp8)  # FP8 is applied, and trains as high precision does
    return runs
