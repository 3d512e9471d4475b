"""Observability: profiler trace for a step range, non-finite loss detected without a
per-step host sync, TensorBoard when installed."""
from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed

DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", "6"]


def test_nonfinite_loss_raises_on_every_rank_at_the_next_log_interval():
    out = run_distributed(2, "tests.training.jobs_observability:train_with_nan_loss",
                          argv=DENSE + ["--log-interval", "3"], nan_at=2)
    for rank in out:
        assert rank["error"] is not None and "iteration 2" in rank["error"], rank
        assert rank["history"] is None
        assert rank["host_checks"] == 1  # one collective at iteration 3, none per step


def test_nonfinite_check_off_trains_through():
    out = run_distributed(2, "tests.training.jobs_observability:train_with_nan_loss",
                          argv=DENSE + ["--log-interval", "3", "--no-check-for-nan-in-loss-and-grad"], nan_at=2)
    history = out[-1]["history"]
    assert out[-1]["error"] is None and len(history) == 6
    assert history[1]["lm loss"] != history[1]["lm loss"]  # NaN logged


def test_finite_run_checks_once_per_log_interval():
    out = run_distributed(2, "tests.training.jobs_observability:train_with_nan_loss",
                          argv=DENSE + ["--log-interval", "2"], nan_at=-1)
    assert out[0]["error"] is None
    assert out[0]["host_checks"] == 6 // 2 + 1  # every log interval, plus once at exit


def test_torch_profiler_trace_covers_the_step_range(tmp_path):
    tb = tmp_path / "tb"
    run_distributed(2, "tests.training.jobs_observability:train", argv=DENSE + [
        "--log-interval", "100", "--profile", "--use-pytorch-profiler",
        "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "1",
        "--tensorboard-dir", str(tb),
    ])
    trace_dir = tmp_path / "torch_profile"
    assert sorted(os.listdir(trace_dir)) == ["rank-1.json.gz"]
    with gzip.open(trace_dir / "rank-1.json.gz", "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    steps = sorted(n for n in names if n and n.startswith("iteration_"))
    assert steps == ["iteration_3", "iteration_4"]  # megatron's convention: iterations S+1..E
    assert any(n and "aten::mm" in n for n in names)


def test_profile_range_checked_before_compute():
    with pytest.raises(ConfigError, match="--profile-step-end"):
        arguments.parse(DENSE + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "4",
                                 "--profile-step-end", "4"], exit_on_dry_run=False)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_events_written(tmp_path):
    run_distributed(2, "tests.training.jobs_observability:train",
                    argv=DENSE + ["--log-interval", "2", "--tensorboard-dir", str(tmp_path)])
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path))


def test_tensorboard_dir_without_tensorboard_still_trains(tmp_path):
    history = run_distributed(2, "tests.training.jobs_observability:train",
                              argv=DENSE + ["--log-interval", "100", "--tensorboard-dir", str(tmp_path)])[-1]
    assert len(history) == 6


def test_feature_counters_appear_in_the_log_line():
    """Offloaded activation bytes and exposed TP communication are logged when those features run."""
    argv = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--train-iters", "3", "--log-interval", "1",
            "--tensor-model-parallel-size", "2", "--overlap-tp-comm-1f1b",
            "--activation-offload-modules", "core_attention", "--activation-offload-min-tensor-kb", "0",
            "--world-size", "2"]
    histories = run_distributed(2, "tests.training.jobs:train_with_counters", argv=argv)
    counters = histories[-1]
    assert float(counters["TP comm exposed (ms)"]) > 0
    assert float(counters["act offloaded (MiB)"]) > 0
