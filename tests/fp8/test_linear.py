"""FP8 in megatron's parallel linears (megatron_ext/seams/fp8.py): torchao's Float8Linear bit for bit at
TP1, TP2 + sequence parallelism equal to TP1, the weight gradient accumulated into main_grad, the
zero-sync grouped experts' product equal to each expert's own FP8 linear."""
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
    assert result["frozen_equals_trainable"]
    assert result["in_place_add"]
    # output, input gradient, each expert's weight gradient (one expert without rows)
    assert result["grouped_vs_each_expert"] == [True] * 5
    assert max(result["tp2_sp_rel"]) < 1e-4, result


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
