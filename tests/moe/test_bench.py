"""scripts/bench_dispatcher.py's multihot part (the layer part is the audit the dist tests assert)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_dispatcher", os.path.join(ROOT, "scripts", "bench_dispatcher.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_multihot_section():
    out = load_bench().bench_multihot(tokens=512, topk=4, experts=16, reps=2)
    assert out["syncs_reference"] == 3 and out["syncs_ours"] == 0
    assert out["bitwise_equal"] is True and out["cases"] >= 20
    assert out["time_ours_over_reference"] > 0
