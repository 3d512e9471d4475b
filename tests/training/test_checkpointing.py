"""Checkpointing: a resumed run logs exactly the losses of an uninterrupted one; a crash in
the middle of a save leaves the previous checkpoint the one that loads; retention; resharding.

Every run goes through train.main in the persistent gloo workers (tests/dist.py). Dropout is on
wherever the RNG state matters, so a resume that lost it would show."""
from __future__ import annotations

import os

import pytest

from megatron_ext.training.checkpointing import TRACKER, complete_iterations, retained
from tests.dist import run_distributed

TOTAL, SPLIT = 4, 2  # uninterrupted: iterations 1..4; interrupted: 1..2, save, resume, 3..4
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", str(TOTAL), "--log-interval", "100"]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--train-iters", str(TOTAL), "--log-interval", "100"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]

_UNINTERRUPTED: dict = {}


def train(world: int, argv: list[str]) -> list[dict]:
    """The history of the last rank (where the loss lives)."""
    return run_distributed(world, "tests.training.jobs_ckpt:train", argv=argv)[-1]


def uninterrupted(world: int, argv: list[str]) -> list[dict]:
    key = (world, tuple(argv))
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = train(world, argv)
    return _UNINTERRUPTED[key]


def losses(history: list[dict]) -> list[tuple]:
    return [(r["iteration"], r["lm loss"], r["grad norm"]) for r in history]


def interrupted(world: int, argv: list[str], save: str, first_extra=(), resume_extra=()) -> list[dict]:
    """Iterations 1..SPLIT, save and exit; then a new run resumes from --load and finishes."""
    first = train(world, argv + ["--save", save, "--save-interval", str(SPLIT), "--exit-interval", str(SPLIT),
                                 *first_extra])
    assert [r["iteration"] for r in first] == list(range(1, SPLIT + 1))
    assert complete_iterations(save) == [SPLIT]
    second = train(world, argv + ["--load", save, "--save", save, "--save-interval", str(SPLIT), *resume_extra])
    assert second[0]["iteration"] == SPLIT + 1, "did not resume at the saved iteration"
    return first + second


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_resume_equals_uninterrupted_dp2_distributed_optimizer(tmp_path, async_save):
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    extra = ["--async-save"] if async_save else []
    resumed = interrupted(2, argv, str(tmp_path), first_extra=extra, resume_extra=extra)
    assert losses(resumed) == losses(uninterrupted(2, argv))
    assert complete_iterations(str(tmp_path)) == [SPLIT, TOTAL]  # saved at exit too
    assert open(tmp_path / TRACKER).read() == str(TOTAL)


def test_resume_equals_uninterrupted_tp2_pp2(tmp_path):
    argv = DENSE + DROPOUT + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--overlap-tp-comm-1f1b",
    ]
    assert losses(interrupted(4, argv, str(tmp_path))) == losses(uninterrupted(4, argv))


def test_resume_equals_uninterrupted_ep2(tmp_path):
    argv = MOE + ["--hidden-dropout", "0.1", "--expert-model-parallel-size", "2",
                  "--use-distributed-optimizer", "--moe-sync-free-dispatcher"]
    assert losses(interrupted(2, argv, str(tmp_path))) == losses(uninterrupted(2, argv))


def test_resume_equals_uninterrupted_ep2_overlapped_grad_reduce_and_param_gather(tmp_path):
    """With --overlap-param-gather a step updates only this rank's shard of each parameter until the
    next forward gathers the rest: a save must gather first, or the checkpoint holds the previous
    step's weights there (without it: iteration 3 logs 5.6157 instead of 5.6078)."""
    argv = MOE + ["--hidden-dropout", "0.1", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                  "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-num-buckets", "2"]
    assert losses(interrupted(2, argv, str(tmp_path))) == losses(uninterrupted(2, argv))


def test_resume_without_rng_state_differs(tmp_path):
    """The equality above has teeth: the same resume without the RNG state (dropout on) differs."""
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    resumed = interrupted(2, argv, str(tmp_path), resume_extra=["--no-load-rng"])
    full = uninterrupted(2, argv)
    assert losses(resumed)[:SPLIT] == losses(full)[:SPLIT]
    assert losses(resumed)[SPLIT:] != losses(full)[SPLIT:]


@pytest.mark.parametrize("how,mode", [("raise", "sync"), ("exit", "async")],
                         ids=["write-error-sync", "writer-killed-async"])
def test_crash_mid_save_leaves_previous_checkpoint_loadable(tmp_path, how, mode):
    save = str(tmp_path)
    argv = DENSE + DROPOUT + ["--use-distributed-optimizer"]
    extra = ["--async-save"] if mode == "async" else []
    out = run_distributed(
        2, "tests.training.jobs_ckpt:train_with_crash_mid_save",
        argv=argv + ["--save", save, "--save-interval", str(SPLIT), *extra],
        save_dir=save, crash_iteration=TOTAL, how=how,
    )[0]
    assert out["error"] is not None and "CheckpointException" in out["error"], out
    assert out["partial_files"], "the crash should have come after some files were written"
    assert f"iter_{TOTAL:07d}.partial" in out["listing"] and f"iter_{TOTAL:07d}" not in out["listing"]
    assert complete_iterations(save) == [SPLIT]
    assert open(os.path.join(save, TRACKER)).read() == str(SPLIT)

    resumed = train(2, argv + ["--load", save, "--save", save, "--save-interval", "100"])
    assert resumed[0]["iteration"] == SPLIT + 1
    assert losses(resumed) == losses(uninterrupted(2, argv))[SPLIT:]
    assert complete_iterations(save) == [SPLIT, TOTAL]
    assert not any(n.endswith(".partial") for n in os.listdir(save)), "stale partial save not cleaned"


def test_keep_last_k(tmp_path):
    save = str(tmp_path)
    train(2, DENSE + ["--save", save, "--save-interval", "1", "--save-keep-last", "2"])
    assert complete_iterations(save) == [TOTAL - 1, TOTAL]
    assert sorted(os.listdir(save)) == sorted([f"iter_{TOTAL - 1:07d}", f"iter_{TOTAL:07d}", TRACKER])


def test_retention_rule():
    its = [10, 20, 30, 40, 50]
    assert retained(its, None, None) == set(its)
    assert retained(its, 2, None) == {40, 50}
    assert retained(its, 1, 20) == {20, 40, 50}
    assert retained(its, None, 30) == {30, 50}  # megatron's --save-retain-interval alone


def test_resume_into_another_layout_tp2_to_dp2(tmp_path):
    """dist_checkpointing reshards a TP=2 checkpoint for TP=1 x DP=2. Not bit-equal: fp32
    summation order differs between layouts (and the RNG state is per layout, so no dropout)."""
    save = str(tmp_path)
    tp2 = DENSE + ["--tensor-model-parallel-size", "2"]
    train(2, tp2 + ["--save", save, "--save-interval", str(SPLIT), "--exit-interval", str(SPLIT)])
    resumed = train(2, DENSE + ["--load", save])
    assert resumed[0]["iteration"] == SPLIT + 1
    expected = uninterrupted(2, tp2)[SPLIT:]
    for got, want in zip(resumed, expected):
        assert got["lm loss"] == pytest.approx(want["lm loss"], rel=1e-5)
        assert got["grad norm"] == pytest.approx(want["grad norm"], rel=1e-4)
