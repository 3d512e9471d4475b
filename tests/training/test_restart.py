"""A world restarted by `torchrun --max-restarts` after a rank was SIGKILLed (no handler runs) comes
up, removes what the killed attempt's interrupted async save left, loads the newest intact
checkpoint and trains on with the losses of an uninterrupted run, bit for bit.

One torchrun job, two attempts: attempt 0 saves at 2 and 4 with --async-save and loses rank 1
mid-step at iteration 5 (after its forward and backward passes, before the optimizer step), while
the save of 4 is written but not committed: --async-save commits at the first step that finds
every writer done, the one after the step that was killed. Attempt 1 must not load that
`.partial` save, removes it, resumes from iteration 2 and finishes; the iterations both attempts
logged (3 and 4) carry the same losses. scripts/soak.py's smoke form runs it (the full soak compares
every faulted job with an uninterrupted reference job); the fault is injected by
tests/training/restart_probe.py (which also kills inside a commit)."""
from __future__ import annotations

import json
import os

import pytest

from tests.scripts import load_script

soak = load_script("soak")  # the probed job's torchrun command, as scripts/soak.py launches it


# the one test that cannot use the warm pools: a torchrun job starts fresh interpreters (two per attempt),
# about 45 s of CPU; the default 120 s bound is too tight on a shared 2-core machine
@pytest.mark.timeout(300)
def test_rank_sigkilled_mid_step_during_an_async_save_restarts_and_resumes_exactly(monkeypatch, capsys):
    """scripts/soak.py --smoke end to end: one job whose rank 1 is SIGKILLed mid-step at iteration 5."""
    # the save of 2 is committed before the save of 4 starts, however slowly the writer of 2 runs
    # on a loaded machine: the kill at 5 finds the save of 4, and only it, in flight
    monkeypatch.setenv("RESTART_PROBE_ONE_SAVE_IN_FLIGHT", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    summary = soak.main(["--smoke", "--json"])
    assert json.loads(capsys.readouterr().out) == summary
    jobs = {job["fault"]: job for job in summary["jobs"]}
    assert summary["cases"] == [soak.SMOKE] and list(jobs) == ["step"], summary
    # the restarted attempt's iterations 3 and 4 equal the first attempt's, bit for bit (floats from JSON repr)
    assert summary["totals"] == dict(runs=1, faults=1, restarts=1, exact=1, crashes=0, failed=0), summary
    job = jobs["step"]
    assert job["iterations"] == [[1, 2, 3, 4], [3, 4, 5, 6]], job  # attempt -> iterations on the last rank
    assert job["sigkills"] == 1, job  # the fault was a SIGKILL, the only one
    lines = job["said"]
    restart = next(i for i, line in enumerate(lines) if line.startswith("[restart] "))
    save = lines[restart].rsplit("--load=", 1)[1]
    assert lines[restart] == (f"[restart] restart 1 of this job (TORCHELASTIC_RESTART_COUNT=1): resuming from "
                              f"the newest intact checkpoint under --load={save}")
    partial = os.path.join(save, "iter_0000004.partial")
    assert not any(line.startswith(f"[checkpoint] saved checkpoint {partial[:-len('.partial')]} ")
                   for line in lines[:restart]), lines
    # the interrupted save of 4 was never loaded, and was removed
    assert lines[restart + 1] == f"[checkpoint] removed {partial}: a save or delete a killed run left unfinished"
    assert lines[restart + 2].startswith(f"[checkpoint] resuming from checkpoint {os.path.join(save, 'iter_0000002')} "
                                         "at iteration 2 "), lines
    assert job["checkpoints"] == ["iter_0000002", "iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_a_probed_job_binds_its_own_rendezvous_port():
    """No port is found free beforehand and handed to torchrun: another process (any gloo pair of
    a job beside it) can bind it first, and torchrun's static rendezvous died of EADDRINUSE. The
    c10d rendezvous binds port 0 itself and keeps that store for the restarted workers (the test
    above restarts one)."""
    cmd = soak.probe_command(2, "records", "", ["--recipe", "recipes/tiny_dense.yaml"])
    assert not any(a.startswith(("--master-port", "--master_port")) for a in cmd), cmd
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv-endpoint") + 1].rsplit(":", 1)[1] == "0"
