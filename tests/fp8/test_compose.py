"""FP8 composes: activation offload changes nothing (bitwise losses and gradient norms), a resumed run
logs the uninterrupted run's losses bitwise, an FP8-trained checkpoint loads and trains in high
precision, LoRA trains its adapters on an FP8 base."""
from __future__ import annotations

from tests.dist import run_distributed

ARGV = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--num-layers", "2", "--global-batch-size", "2",
        "--seq-length", "32", "--log-interval", "1", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
        "--hidden-dropout", "0.1"]


def _losses(history):
    return [(h["iteration"], repr(h["lm loss"]), h["grad norm"]) for h in history]


def test_fp8_composes(tmp_path):
    r = run_distributed(1, "tests.fp8.jobs:compose", argv=ARGV, save=str(tmp_path / "ckpt"))[0]
    straight = _losses(r["straight"])
    assert len(straight) == 3
    assert r["offloaded_bytes"] > 0 and _losses(r["offloaded"]) == straight
    assert _losses(r["first"]) + _losses(r["resumed"]) == straight
    loaded = r["high_precision_from_fp8"]
    assert [h["iteration"] for h in loaded] == [3] and loaded[0]["lm loss"] == loaded[0]["lm loss"]
    assert repr(loaded[0]["lm loss"]) != straight[2][1]  # it ran in high precision
    lora = r["lora"]
    assert lora["fp8_linears"] == 8 and len(lora["losses"]) == 3
