"""FP8 in megatron's parallel linears (megatron_ext/seams/fp8.py): torchao's Float8Linear bit for bit at
TP1, TP2 + sequence parallelism equal to TP1, the weight gradient accumulated into main_grad; the
zero-sync grouped experts' FP8 product bit for bit torchao's MoE float8 recipe, expert-TP 2 equal to 1."""
from __future__ import annotations

import re

import pytest

from tests.dist import run_distributed


@pytest.mark.parametrize("fmt", ["hybrid"])
def test_linear_numerics(fmt):
    result = run_distributed(2, "tests.fp8.jobs:linear_numerics", fmt=fmt)[0]
    # output, input gradient, fc1's and fc2's weight gradients
    assert result["bitwise_vs_torchao_hybrid"] == result["bitwise_vs_torchao_e4m3"] == [True] * 4
    # e4m3 and hybrid differ in the output gradient's format only: same output, other gradients
    assert result["formats_differ"] == [False, True, True, True]
    assert result["differs_from_high_precision"] == [True] * 4  # FP8 is really applied
    assert max(result["close_to_high_precision"]) < 0.25, result  # e5m2 gradients: 2 mantissa bits
    assert result["main_grad_fused"]
    assert result["no_fp8_wgrad"]
    assert result["frozen_equals_trainable"]
    assert result["in_place_add"]
    assert max(result["tp2_sp_rel"]) < 1e-4, result


def test_grouped_experts_numerics():
    result = run_distributed(2, "tests.fp8.jobs:grouped_numerics")[0]
    # output, input gradient, each expert's weight gradient (one expert without rows, none a multiple of 16)
    assert result["bitwise_vs_torchao"] == [True] * 6, result
    assert all(result["differs_from_high_precision"]), result  # FP8 is really applied
    assert max(result["close_to_high_precision"]) < 0.1, result
    assert result["padding_rows_zero"]
    # --no-fp8-wgrad: each expert's weight gradient is the high-precision grouped product's, bit for bit
    assert result["no_fp8_wgrad"] == [0.0] * 4 and result["no_fp8_wgrad_same_dx"], result
    # the CPU arithmetic of torch._scaled_grouped_mm: per-group torch._scaled_mm's to bf16's last bit
    assert result["kernel_arithmetic_vs_scaled_mm"] <= 2 ** -8, result
    # column-parallel, row-parallel: the sharded contraction's amax all-reduced
    assert max(result["expert_tp2_rel"]) < 1e-2, result


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_zero_sync_layer_in_fp8_has_no_host_sync(dispatcher):
    """The grouped experts' FP8 products keep the layer's promise: no host sync forward or backward
    (CUDA-faithful residency), while FP8 changes the output, the input and the experts' weight gradients."""
    for r in run_distributed(2, "tests.fp8.jobs:zero_sync_layer_syncs", dispatcher=dispatcher):
        assert tuple(r["syncs"]) == (0, 0), r["sites"]
        assert all(r["differs"]) and len(r["differs"]) > 2, r["differs"]
        assert r["close"] < 0.1, r


def test_compiled_casts_compile_once_for_every_linear():
    """The casts compiled as on CUDA, through five linear pairs of other shapes and token counts: dynamo
    makes its graphs for the first pair and none after (on an H200 it recompiled per linear, guarding on a
    parameter's class and a view's base, until its limit: with the tensors not detached this test sees
    9, 11, 12 graphs), and every pair's output and gradients equal the eager casts' bit for bit."""
    r = run_distributed(1, "tests.fp8.jobs:compiled_casts")[0]
    assert r["graphs"] == [r["graphs"][0]] * len(r["graphs"]) and 0 < r["graphs"][0] <= 8, r
    assert all(r["same"]), r


DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--fp8-format", "hybrid"]


@pytest.mark.parametrize("argv,match", [
    (DENSE, r"^--fp8-recipe=delayed, --transformer-impl=local: the local spec's FP8 is torchao's float8 training "
            r"with tensorwise scaling .* \(torchao has no delayed scaling; use tensorwise, or transformer-engine\); "
            r"`--dry-run --platform cuda --assume-te`"),
    (DENSE + ["--fp8-recipe", "mxfp8"], r"^--fp8-recipe=mxfp8, --transformer-impl=local: .*\(mxfp8 needs "),
    (DENSE + ["--fp8-recipe", "blockwise"], r"^--fp8-recipe=blockwise, --transformer-impl=local: .*no blockwise"),
    (DENSE + ["--fp8-recipe", "tensorwise", "--fp8-param-gather", "--use-distributed-optimizer"],
     r"^--fp8-param-gather: the local spec keeps its parameters in high precision"),
    (DENSE + ["--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "5"],
     r"^--num-layers-at-start-in-bf16=5: must be between 0 and the layers per pipeline stage \(4\)$"),
    (DENSE + ["--fp8-recipe", "tensorwise", "--platform", "cuda", "--target-gpu", "a100"],
     r"^--fp8-format=hybrid: FP8 products need a GPU with FP8 tensor cores \(compute capability >= 8\.9\); this one "
     r"has 8\.0$"),
    (DENSE + ["--fp8-recipe", "tensorwise", "--ffn-hidden-size", "200"],
     r"^--fp8-format=hybrid: decoder\.layers\.0\.mlp\.linear_fc2 has a weight of \[64, 200\] on this rank; FP8 "
     r"products need both dimensions divisible by 16$"),
])
def test_refused_in_one_line(argv, match):
    import arguments
    from megatron_ext.errors import ConfigError

    if "--ffn-hidden-size" in argv:  # a weight's shape: refused as the model is built, before any compute
        line = run_distributed(1, "tests.fp8.jobs:build", argv=argv)[0]
    else:
        with pytest.raises(ConfigError) as info:
            arguments.parse(argv + ["--dry-run"], exit_on_dry_run=False)
        line = str(info.value)
    assert re.match(match, line) and "\n" not in line, line
