"""(c) The SFT loss is token-weighted over the global batch: the same number whatever the micro-batch,
data-, tensor- or pipeline-parallel split, in training (--calculate-per-token-loss, which --sft sets: the
second and third losses follow from token-weighted gradients) and in validation (megatron's evaluate()
would average per-micro-batch means under --sft; megatron_ext/seams/sft.py). Packed rows hold different
numbers of assistant tokens, so a per-micro-batch mean would differ between these splits."""
from __future__ import annotations

import re

import pytest

from tests.dist import run_distributed
from tests.sft import chats

VALID = re.compile(r" validation loss at (iteration \d+(?: on \w+ set)?) \([^)]*\) \| lm loss value: (\S+) \|")
BASE = ["--recipe", chats.RECIPE, "--train-iters", "3", "--lr-warmup-iters", "1", "--log-interval", "1",
        "--eval-interval", "3", "--eval-iters", "1", "--layout-invariant-init"]
SPLITS = {
    "one process, micro-batch 2": (1, []),
    "DP2, micro-batch 1": (2, ["--micro-batch-size", "1"]),
    "TP2 + SP, micro-batch 4": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "4"]),
    "PP2, micro-batch 2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def run(world: int, extra: list[str]) -> tuple[list[float], dict]:
    ranks = run_distributed(world, "tests.training.jobs_flags:train_capture",
                            argv=BASE + extra + ["--world-size", str(world)])
    last = ranks[-1]
    return [r["lm loss"] for r in last["history"]], {m[1]: float(m[2]) for m in VALID.finditer(last["stdout"])}


def test_loss_is_the_same_on_every_split():
    results = {name: run(*split) for name, split in SPLITS.items()}
    train, valid = results.pop("one process, micro-batch 2")
    assert len(train) == 3 and set(valid) == {"iteration 3", "iteration 3 on validation set"}
    assert train[-1] < train[0]
    for name, (other_train, other_valid) in results.items():
        assert other_train == pytest.approx(train, rel=2e-6), name
        assert other_valid == pytest.approx(valid, rel=2e-6), name
