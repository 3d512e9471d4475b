"""Megatron-FSDP's fetch with the fsdp_fetch seam against stock (megatron_ext/seams/fsdp_fetch.py),
and the per-layer figures scripts/bench_fsdp.py reports (scripts/bench/fsdp.py)."""
from __future__ import annotations

import json

import pytest

from tests.dist import run_distributed

import bench_fsdp  # noqa: E402 (scripts/ is on the tests' path: pytest.ini)

EXPERTS = (4, 8)


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, "tests.seams.jobs_fsdp:fsdp_fetch_bitwise_and_counts", experts=EXPERTS)


def test_bit_identical_to_stock(results):
    for r in results:
        # stock's per-parameter hooks; ours: per unit, both layers' fetch / release hooks per bucket
        assert r["unit_hooks"] == ((False, 0), (True, 2))
        assert r["outputs_differ_between_steps"]  # the update reaches the next fetch
        assert r["same"] == {"out": True, "dx": True, "grads": True, "optimizer_grads": True, "weights": True}, \
            r["same"]


def _case(r, experts, ours):
    (c,) = [c for c in r["counts"] if c["E"] == experts and (c["impl"] == "ours") == ours]
    return c


def test_per_layer_counts(results):
    for r in results:
        for ours in (False, True):
            small, large = _case(r, EXPERTS[0], ours), _case(r, EXPERTS[1], ours)
            assert large["param_tensors_per_layer"] > small["param_tensors_per_layer"]
            # One coalesced all-gather / reduce-scatter per parameter group: flat in E.
            assert small["collectives_per_layer"] == large["collectives_per_layer"] > 0
            assert small["event_calls_per_layer"] == large["event_calls_per_layer"]
            for c in (small, large):
                assert c["post_gather_copies_per_layer"] == 0  # parameters view the gathered bucket
                assert c["released_bytes_per_layer"] == c["bytes_after_fetch_per_layer"] > 0
                assert c["bytes_after_release_per_layer"] == 0 and c["resident_after_step"] == 0
        # Stock: host ops grow by 9 per parameter tensor (views on each fetch, the gradient's view and
        # copy, the optimizer's shard view); ours: the same count at any E.
        small, large = _case(r, EXPERTS[0], False), _case(r, EXPERTS[1], False)
        growth = large["param_tensors_per_layer"] - small["param_tensors_per_layer"]
        assert large["host_ops_per_layer"] - small["host_ops_per_layer"] == 9 * growth
        assert _case(r, EXPERTS[0], True)["host_ops_per_layer"] == _case(r, EXPERTS[1], True)["host_ops_per_layer"]
        for e in EXPERTS:
            stock, ours = _case(r, e, False), _case(r, e, True)
            assert ours["collectives_per_layer"] == stock["collectives_per_layer"]
            assert ours["host_ops_per_layer"] < stock["host_ops_per_layer"]
            assert ours["copies_per_layer"] < stock["copies_per_layer"]


def test_json_shape(results):
    rows = [{k: c[k] for k in bench_fsdp.KEYS} for c in results[0]["counts"]]
    out = json.loads(json.dumps({"device": bench_fsdp.DEVICE, "world_size": 2, "layers": 2, "cases": rows}))
    for row in out["cases"]:
        assert row["impl"] in ("stock", "ours") and row["E"] in EXPERTS
        for key in ("collectives_per_layer", "host_ops_per_layer", "host_us_per_layer", "released_bytes_per_layer"):
            assert isinstance(row[key], (int, float)), key
    assert "megatron_fsdp" in bench_fsdp.table(out)
    assert [(e, w, o) for e, w, o in bench_fsdp.case_list([8, 128], ["megatron_fsdp", "fsdp2"])] == [
        (8, "megatron_fsdp", False), (8, "megatron_fsdp", True), (8, "fsdp2", False),
        (128, "megatron_fsdp", False), (128, "megatron_fsdp", True), (128, "fsdp2", False)]


@pytest.mark.parametrize("extra", [[], ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                         "--recompute-num-layers", "1"], ["--expert-model-parallel-size", "2"]],
                         ids=["plain", "full_recompute", "ep2"])
def test_train_py_runs_bitwise_with_the_seams(extra):
    """What a --use-megatron-fsdp run installs: the same losses and grad norms, bit for bit, as
    megatron-core's own code (MoE, 8 experts, two layers: two FSDP units, DP2, optim_grads_params);
    with full recompute the units' hooks run inside the recomputed forward and its backward; with
    EP2 the expert gradients are not sharded (expert data-parallel size 1) and are accumulated in
    place."""
    argv = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--train-iters", "2", "--lr-warmup-iters", "0",
            "--log-interval", "100", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
            "--data-parallel-sharding-strategy", "optim_grads_params", "--world-size", "2"] + extra
    for r in run_distributed(2, "tests.seams.jobs_fsdp:train_with_and_without", argv=argv):
        assert len(r["stock"]) == 2 and r["stock"][-1][0] < r["stock"][0][0]
        assert r["unit_hooks"] == [True]
        assert r["ours"] == r["stock"]


def test_a_megatron_fsdp_run_installs_the_seams_and_teardown_removes_them():
    from megatron_ext.seams import fsdp_fetch, registry
    from tests.parsed import parsed_args

    assert not any(r.active for r in fsdp_fetch.SEAMS)
    registry.install(parsed_args())
    assert not any(r.active for r in fsdp_fetch.SEAMS)  # not without --use-megatron-fsdp
    registry.install(parsed_args(use_megatron_fsdp=True))
    assert all(r.active for r in fsdp_fetch.SEAMS)
    registry.uninstall()
    assert not any(r.active for r in fsdp_fetch.SEAMS)
