"""scripts/bench_dispatcher.py's multihot part (the layer part is the audit the dist tests assert)."""
from tests.scripts import load_script


def load_bench():
    return load_script("bench_dispatcher")


def test_multihot_section():
    out = load_bench().bench_multihot(tokens=512, topk=4, experts=16, reps=2)
    assert out["syncs_reference"] == 3 and out["syncs_ours"] == 0
    assert out["bitwise_equal"] is True and out["cases"] >= 20
    assert out["time_ours_over_reference"] > 0
