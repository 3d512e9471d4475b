"""tiny_dense and tiny_moe train in FP8 (megatron_ext/fp8): every transformer-layer linear in FP8 and
nothing else, losses that differ from high precision's (FP8 is applied) and stay within 3 % of them
after 30 iterations. The MoE model carries multi-latent attention, a shared expert and the zero-sync
grouped experts."""
from __future__ import annotations

from tests.dist import run_distributed

ITERS = ["--train-iters", "30", "--log-interval", "1", "--mock-data", "--num-layers", "2", "--global-batch-size", "2",
         "--seq-length", "32", "--bf16"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
DENSE = ["--recipe", "recipes/tiny_dense.yaml", *ITERS]
MOE = ["--recipe", "recipes/tiny_moe.yaml", *ITERS, "--moe-shared-expert-intermediate-size", "32",
       "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16", "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless", "--num-experts", "4"]


def _check(high, low, linears_per_layer):
    assert high["fp8_linears"] == 0
    assert low["fp8_linears"] == len(low["names"]) == 2 * linears_per_layer
    assert not [n for n in low["names"] if "output_layer" in n or "router" in n or "embedding" in n]
    assert all(".decoder.layers." in n for n in low["names"])
    assert low["names_first_bf16"] == [n for n in low["names"] if ".decoder.layers.1." in n]
    assert high["losses"] != low["losses"]  # FP8 is really applied
    assert abs(low["losses"][-1] - high["losses"][-1]) / high["losses"][-1] < 0.03
    assert low["losses"][-1] < 0.8 * low["losses"][0]  # it trains


def test_dense_trains_in_fp8():
    r = run_distributed(1, "tests.fp8.jobs:train", argvs={"bf16": DENSE, "fp8": DENSE + FP8,
                                                           "fp8, wgrad high": DENSE + FP8 + ["--no-fp8-wgrad"]})[0]
    _check(r["bf16"], r["fp8"], linears_per_layer=4)  # linear_qkv, linear_proj, linear_fc1, linear_fc2
    # --no-fp8-wgrad (hybrid: its e5m2 output gradient once made torchao refuse the config): it trains,
    # and its weight gradients are not FP8's
    _check(r["bf16"], r["fp8, wgrad high"], linears_per_layer=4)
    assert r["fp8, wgrad high"]["losses"] != r["fp8"]["losses"]


def test_moe_trains_in_fp8():
    r = run_distributed(1, "tests.fp8.jobs:train", argvs={"bf16": MOE, "fp8": MOE + FP8})[0]
    # MLA's five projections, a shared expert's two linears, 4 experts x 2
    _check(r["bf16"], r["fp8"], linears_per_layer=5 + 2 + 8)
