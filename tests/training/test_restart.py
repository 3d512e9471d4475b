"""A world restarted by `torchrun --max-restarts` after a rank was SIGKILLed (no handler runs) comes
up, removes what the killed attempt's interrupted async save left, loads the newest intact
checkpoint and trains on with the losses of an uninterrupted run, bit for bit.

One torchrun job, two attempts: attempt 0 saves at 2 and 4 with --async-save and loses rank 1
mid-step at iteration 5 (after its forward and backward passes, before the optimizer step), while
the save of 4 is written but not committed: --async-save commits at the first step that finds
every writer done, the one after the step that was killed. Attempt 1 must not load that
`.partial` save, removes it, resumes from iteration 2 and finishes. The fault is injected by
tests/training/restart_probe.py (which also kills inside a commit: scripts/soak.py)."""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from tests.dist import run_distributed
from tests.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--recipe", "recipes/tiny_dense.yaml", "--train-iters", "6", "--log-interval", "100",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--use-distributed-optimizer", "--async-save"]
soak = load_script("soak")  # the probed job's torchrun command, as scripts/soak.py launches it


def records(directory: str, attempt: int, rank: int) -> list[tuple]:
    path = os.path.join(directory, f"a{attempt}.r{rank}.jsonl")
    with open(path) as f:
        return [(r["iteration"], r["lm loss"], r["grad norm"]) for r in map(json.loads, f)]


# the one test that cannot use the warm pools: a torchrun job starts four fresh interpreters (two
# per attempt), about 25 s of CPU; the default 120 s bound is too tight on a shared 2-core machine
@pytest.mark.timeout(240)
def test_rank_sigkilled_mid_step_during_an_async_save_restarts_and_resumes_exactly(tmp_path):
    save, out = str(tmp_path / "ckpt"), str(tmp_path / "records")
    os.makedirs(out)
    # the save of 2 is committed before the save of 4 starts, however slowly the writer of 2 runs
    # on a loaded machine: the kill at 5 finds the save of 4, and only it, in flight
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RESTART_PROBE_ONE_SAVE_IN_FLIGHT="1")
    done = subprocess.run(
        soak.probe_command(2, out, "0:1:5:step", [*ARGV, "--save", save, "--load", save, "--save-interval", "2"]),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert log.count("(exitcode: -9) local_rank: 1") == 1, log[-4000:]  # the fault was a SIGKILL
    lines = [line for line in done.stdout.splitlines() if line.startswith(("[checkpoint]", "[restart]"))]
    partial = os.path.join(save, "iter_0000004.partial")
    resumed = f"[checkpoint] resuming from checkpoint {os.path.join(save, 'iter_0000002')} at iteration 2 "
    assert not any(line.startswith(f"[checkpoint] saved checkpoint {partial[:-len('.partial')]} ") for line in
                   lines[:lines.index("[restart] restart 1 of this job (TORCHELASTIC_RESTART_COUNT=1): resuming from "
                                      f"the newest intact checkpoint under --load={save}")]), lines
    i = lines.index(f"[restart] restart 1 of this job (TORCHELASTIC_RESTART_COUNT=1): "
                    f"resuming from the newest intact checkpoint under --load={save}")
    # the interrupted save of 4 was never loaded, and was removed
    assert lines[i + 1] == f"[checkpoint] removed {partial}: a save or delete a killed run left unfinished"
    assert lines[i + 2].startswith(resumed), lines
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                        "latest_checkpointed_iteration.txt"]
    assert glob.glob(os.path.join(out, "a2.*")) == []

    full = run_distributed(2, "tests.training.jobs_ckpt:train_capturing", argv=ARGV)[-1]["history"]
    reference = {r["iteration"]: (r["iteration"], r["lm loss"], r["grad norm"]) for r in full}
    seen = {0: [1, 2, 3, 4], 1: [3, 4, 5, 6]}  # attempt -> iterations logged on the last rank
    for attempt, iterations in seen.items():
        got = records(out, attempt, 1)
        assert [r[0] for r in got] == iterations, (attempt, got)
        assert got == [reference[i] for i in iterations], attempt  # bitwise: floats from JSON repr


def test_a_probed_job_binds_its_own_rendezvous_port():
    """No port is found free beforehand and handed to torchrun: another process (any gloo pair of
    a job beside it) can bind it first, and torchrun's static rendezvous died of EADDRINUSE. The
    c10d rendezvous binds port 0 itself and keeps that store for the restarted workers (the test
    above restarts one)."""
    cmd = soak.probe_command(2, "records", "", ["--recipe", "recipes/tiny_dense.yaml"])
    assert not any(a.startswith(("--master-port", "--master_port")) for a in cmd), cmd
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1] == "0"
