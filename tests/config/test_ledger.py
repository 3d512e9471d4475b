"""The flag ledger (megatron_ext/config/ledger.py): every flag of megatron's parser is honoured (by
code that reads it), refused by name, or without effect here for a stated reason; and the flags it
calls honoured do what they do in megatron."""
from __future__ import annotations

import os

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = os.path.join(ROOT, "recipes", "tiny_moe.yaml")


def test_freeze_all_layers_as_megatron():
    """megatron's get_model: no parameter trains and no router's expert bias moves; the logged LR is 0.
    The frozen run's losses are those of a run that changes nothing (LR 0, bias update rate 0), and
    differ from an ordinary run's from the second iteration on (the weights it would have moved)."""
    base = ["--recipe", MOE, "--train-iters", "3", "--lr-warmup-iters", "0", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.5", "--world-size", "1"]
    job = "tests.config.jobs:train_records"
    frozen = run_distributed(1, job, argv=base + ["--freeze-all-layers"])[0]
    still = run_distributed(1, job, argv=base + ["--lr", "0", "--min-lr", "0", "--moe-router-bias-update-rate", "0"])[0]
    trained = run_distributed(1, job, argv=base)[0]
    assert [r["lm loss"] for r in frozen] == [r["lm loss"] for r in still]
    assert [r["learning rate"] for r in frozen] == [0.0] * 3 and [r["grad norm"] for r in frozen] == [0.0] * 3
    assert frozen[0]["lm loss"] == trained[0]["lm loss"]
    assert all(f["lm loss"] != t["lm loss"] for f, t in zip(frozen[1:], trained[1:]))
