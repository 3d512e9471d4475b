"""FP8 in megatron's parallel linears (megatron_ext/seams/fp8.py): torchao's Float8Linear bit for bit at
TP1, TP2 + sequence parallelism equal to TP1, the weight gradient accumulated into main_grad, the
zero-sync grouped experts' product equal to each expert's own FP8 linear."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed


@pytest.mark.parametrize("fmt", ["hybrid"])
def test_linear_numerics(fmt):
    result = run_distributed(2, "tests.fp8.jobs:linear_numerics", fmt=fmt)[0]
    # output, input gradient, fc1's and fc2's weight gradients
    assert result["bitwise_vs_torchao"] == [True] * 4
    assert result["differs_from_high_precision"] == [True] * 4  # FP8 is really applied
    assert max(result["close_to_high_precision"]) < 0.25, result  # e5m2 gradients: 2 mantissa bits
    assert result["main_grad_fused"]
    # output, input gradient, each expert's weight gradient (one expert without rows)
    assert result["grouped_vs_each_expert"] == [True] * 5
    assert max(result["tp2_sp_rel"]) < 1e-4, result
