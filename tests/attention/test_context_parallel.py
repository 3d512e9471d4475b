"""Context parallelism on the local spec (megatron_ext/attention/context_parallel.py): each comm type's
attention over a gloo CP group against the one-rank kernel on the whole sequence, fp32."""
from __future__ import annotations

import pytest

from tests.attention import jobs_cp
from tests.dist import run_distributed

_RUNS: dict = {}


def _kernels(cp: int) -> dict:
    if cp not in _RUNS:
        _RUNS[cp] = run_distributed(cp, "tests.attention.jobs_cp:kernels_match_one_rank")
    return _RUNS[cp]


@pytest.mark.parametrize("cp", [2, 4])
def test_each_comm_type_matches_one_rank(cp):
    """Output and the gradients of queries, keys, values (and sinks) on every rank within 2e-6 of the
    one-rank kernel's same rows: the causal triangle, GQA, narrower values, windows, sinks and a packed
    row's documents under the load-balanced split."""
    expected = {f"{c[0]}/{comm}" for c in jobs_cp.KERNEL_CASES for comm in c[-1]}
    for rank, result in enumerate(_kernels(cp)):
        assert set(result) == expected
        for case, errors in result.items():
            assert max(errors) <= 2e-6, (rank, case, errors)
