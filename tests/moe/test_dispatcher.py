"""The multihot dispatcher inside megatron-core's MoELayer, against the standard dispatchers, on
persistent gloo workers: same outputs and gradients bit for bit, and the syncs each one causes."""
import pytest

from tests.dist import run_distributed

# Syncs (forward, backward) per rank the detector finds in one MoELayer, upstream vs ours.
# Upstream alltoall batches its device-to-host copies behind one event.synchronize
# (token_dispatcher.py:950); allgather reads .cpu() (:317) and masked_select (:328).
EXPECTED = {
    ("alltoall", "dropless"): ((1, 0), (1, 0)),
    ("alltoall", "capacity"): ((0, 0), (0, 0)),
    ("alltoall", "capacity-nopad"): ((1, 0), (0, 0)),
    ("allgather", "dropless"): ((2, 0), (1, 0)),
    ("allgather", "capacity"): ((2, 0), (0, 0)),
    ("allgather", "capacity-nopad"): ((2, 0), (0, 0)),
}


def check(results, dispatcher, mode, bitwise=True):
    ref_syncs, our_syncs = EXPECTED[(dispatcher, mode)]
    for rank, r in enumerate(results):
        assert r["replaced"] == 1, f"rank {rank}: dispatcher not swapped"
        assert r["same_keys"]
        if bitwise:
            assert r["out_equal"] and r["dx_equal"] and r["dw_equal"], (rank, r["max_abs_diff"])
        else:
            assert r["max_abs_diff"] < 1e-5, (rank, r["max_abs_diff"])
        assert tuple(r["syncs_ours"]) == our_syncs, (rank, r["sites_ours"])
        assert tuple(r["syncs_reference"]) == ref_syncs, (rank, r["sites_reference"])
    for r in results:  # which alltoall path ran, and what it sent
        if r["token_level"]:
            assert 0 < r["rows_sent"] <= r["pairs"], r
    if our_syncs[0] == 1:  # the one dropless sync is ours, in the dispatcher, and a host read
        assert all("megatron_ext/moe/dispatcher.py" in r["sites_ours"][0] for r in results)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("mode", ["dropless", "capacity", "capacity-nopad"])
def test_ep2(dispatcher, mode):
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode=mode, ep=2)
    # capacity without padding: upstream runs only the routed rows, we pad; equal to rounding
    check(res, dispatcher, mode, bitwise=mode != "capacity-nopad")


def test_token_level_alltoall_sends_fewer_rows():
    """Dropless top-2 alltoall (expert-TP 1): each token crosses once per destination rank. With 8
    experts on 2 ranks many tokens have both experts on one rank, so fewer rows than upstream's
    (token, expert) pairs; outputs and gradients still bit-identical (check)."""
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher="alltoall", mode="dropless", ep=2,
                          experts=8, topk=2, seq=40)
    check(res, "alltoall", "dropless")
    assert all(r["token_level"] for r in res)
    assert sum(r["rows_sent"] for r in res) < sum(r["pairs"] for r in res), res
    # top-3 keeps per-pair rows (bitwise order of the per-token sums), also checked
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher="alltoall", mode="dropless", ep=2,
                          experts=8, topk=3, seq=40)
    check(res, "alltoall", "dropless")
    assert not any(r["token_level"] for r in res)
    assert all(r["rows_sent"] == r["pairs"] for r in res)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_uneven_load_more_experts(dispatcher):
    """8 experts, top-3, 4 local experts per rank, longer sequence: many uneven splits."""
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode="dropless",
                          ep=2, experts=8, topk=3, seq=40, seed=3)
    check(res, dispatcher, "dropless")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_ep2_padding_mask(dispatcher, mode):
    """Padded positions route nowhere (rows with fewer than K experts)."""
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode=mode, ep=2,
                          padded_tail=5)
    check(res, dispatcher, mode)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_ep4(dispatcher, mode):
    res = run_distributed(4, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode=mode, ep=4,
                          experts=8, topk=2, seq=24)
    check(res, dispatcher, mode)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_topk_equals_experts(dispatcher):
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode="dropless", ep=2,
                          experts=4, topk=4)
    check(res, dispatcher, "dropless")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_tp2_sequence_parallel(dispatcher):
    res = run_distributed(2, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode="dropless",
                          ep=1, tp=2)
    check(res, dispatcher, "dropless")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("mode", ["dropless", "capacity"])
@pytest.mark.parametrize("etp", [1, 2])
def test_ep2_tp2(dispatcher, mode, etp):
    res = run_distributed(4, "tests.moe.jobs:layer_equivalence", dispatcher=dispatcher, mode=mode,
                          ep=2, tp=2, etp=etp)
    check(res, dispatcher, mode)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_capacity_layer_is_shape_static(dispatcher):
    """With a capacity factor every op of our layer (fwd+bwd, collectives included) has the same
    output shapes whatever the routing — graph-capturable; dropless does not (the test can fail)."""
    for mode in ("capacity", "capacity-nopad"):
        res = run_distributed(2, "tests.moe.jobs:shape_trace", dispatcher=dispatcher, mode=mode)
        assert all(r["same"] and r["ops"] > 100 for r in res), (mode, res)
    res = run_distributed(2, "tests.moe.jobs:shape_trace", dispatcher=dispatcher, mode="dropless")
    assert not all(r["same"] for r in res)
    # upstream without padding is not static (it syncs to learn the routed count)
    res = run_distributed(2, "tests.moe.jobs:shape_trace", dispatcher=dispatcher, mode="capacity-nopad", ours=False)
    assert not all(r["same"] for r in res)
