"""The worker pool's leak check fails the job that leaves threads or process groups behind, names
what it left, and the pool recovers for the next job."""
from __future__ import annotations

import pytest

from tests.dist import run_distributed


def test_workers_start_with_the_fork_servers_imports():
    # the server skips a preload it cannot import without a word: every worker would pay the imports
    assert run_distributed(1, "tests.pool_jobs:preloaded") == [
        ["arguments", "megatron.training.training", "tests._preload", "train"]]


def test_a_job_that_leaks_a_thread_fails_by_name_and_the_pool_recovers():
    before = run_distributed(1, "tests.pool_jobs:worker_pid")  # one rank: the check is per process
    assert run_distributed(1, "tests.pool_jobs:join_thread") == [1]  # joined threads are fine
    with pytest.raises(RuntimeError) as failed:
        run_distributed(1, "tests.pool_jobs:leak_thread")
    message = str(failed.value)
    assert "tests.pool_jobs:leak_thread leaked" in message
    assert "deliberately-leaked-helper (python)" in message
    after = run_distributed(1, "tests.pool_jobs:worker_pid")  # a fresh pool: the leaky workers are gone
    assert set(after).isdisjoint(before)
    assert run_distributed(1, "tests.pool_jobs:join_thread") == [1]


def test_a_failed_job_keeps_the_pool_only_when_it_left_nothing_behind():
    # a pool restart costs every worker its start (the profiler's threads, the process groups)
    before = run_distributed(2, "tests.pool_jobs:worker_pid")
    with pytest.raises(RuntimeError) as failed:
        run_distributed(2, "tests.pool_jobs:raise_on", rank=1)
    assert "tests.pool_jobs:raise_on failed on rank 1 of 2" in str(failed.value)
    assert "ValueError: deliberately failed" in str(failed.value)
    assert run_distributed(2, "tests.pool_jobs:worker_pid") == before  # the same workers
    with pytest.raises(RuntimeError) as failed:
        run_distributed(2, "tests.pool_jobs:raise_on", rank=0, leak=True)
    assert "ValueError: deliberately failed" in str(failed.value)
    after = run_distributed(2, "tests.pool_jobs:worker_pid")  # the leaky rank's pool was replaced
    assert set(after).isdisjoint(before)


def test_a_job_that_keeps_a_process_group_fails_by_name():
    with pytest.raises(RuntimeError) as failed:
        run_distributed(1, "tests.pool_jobs:leak_process_group")
    message = str(failed.value)
    assert "tests.pool_jobs:leak_process_group leaked" in message
    assert "1 process groups" in message and "ranks [0]" in message
    assert run_distributed(1, "tests.pool_jobs:join_thread") == [1]


def test_a_job_that_leaves_a_seam_in_place_fails_by_name():
    with pytest.raises(RuntimeError) as failed:
        run_distributed(1, "tests.pool_jobs:leave_a_seam")
    assert "tests.pool_jobs:leave_a_seam leaked" in str(failed.value) and "1 seams in place: " in str(failed.value)
    assert run_distributed(1, "tests.pool_jobs:join_thread") == [1]


def test_a_worker_that_dies_fails_its_job_at_once_naming_rank_and_exit_code():
    import time

    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as failed:
        run_distributed(1, "tests.pool_jobs:die", code=17)
    assert "tests.pool_jobs:die: worker process died: rank 0 (exit code 17)" in str(failed.value)
    assert time.monotonic() - t0 < 30, "waited for the job timeout instead of noticing the dead worker"
    assert run_distributed(1, "tests.pool_jobs:join_thread") == [1]
