"""train.py under torchrun, with faults injected by SIGKILL (no handler runs) and every logged
iteration's record appended to a file as it happens, so a killed attempt's losses survive:

    torchrun ... tests/training/restart_probe.py RECORDS KILLS -- <train.py arguments>

RECORDS: a directory; rank r of attempt a appends JSON lines to `a<a>.r<r>.jsonl` (the attempt:
platform.restart_count(), torchrun's restarts plus slurm's requeues).
KILLS: comma-separated `attempt:rank:iteration:where`, where is
    step   SIGKILL mid-step: after the forward and backward passes of the iteration, before the
           optimizer step (the other ranks wait in its collectives)
    save   SIGKILL mid-save: in the commit of the iteration's checkpoint, after this rank's files
           are written (for --async-save, by its forked writer) and before the directory is renamed
    term   SIGTERM mid-step (a preemption), where `step` kills; with --exit-signal-handler the
           run stops after that iteration, saves and exits 0
With RESTART_PROBE_ONE_SAVE_IN_FLIGHT=1 every rank finishes (commits) its pending --async-save
checkpoints before it starts the next save, so exactly one save is in flight at a time, however
slow the machine's writers are: a test that kills during "the save of N" then finds N's and no
older checkpoint unfinished.
Used by tests/training/test_restart.py and scripts/soak.py."""
from __future__ import annotations

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _kills(spec: str) -> dict:
    """{where: iteration} for this attempt and rank."""
    from megatron_ext import platform

    attempt, rank = str(platform.restart_count()), os.environ.get("RANK", "0")
    out = {}
    for item in filter(None, spec.split(",")):
        a, r, iteration, where = item.split(":")
        if a == attempt and r == rank:
            out[where] = int(iteration)
    return out


def _die(sig=signal.SIGKILL) -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), sig)


def install(records: str, kills: dict) -> None:
    from megatron_ext import platform
    from megatron_ext.checkpoint import checkpointer as checkpointing
    from megatron_ext.training import log_line, step

    path = os.path.join(records, f"a{platform.restart_count()}.r{os.environ.get('RANK', '0')}.jsonl")
    log = log_line.TrainingLogger.log

    upcoming = [1]  # the iteration the next step computes

    def logged(self, iteration, result, **kwargs):
        record = log(self, iteration, result, **kwargs)
        upcoming[0] = iteration + 1
        with open(path, "a") as f:
            row = {k: v.item() if hasattr(v, "item") else v for k, v in record.items()}  # the loss: a tensor
            f.write(json.dumps({k: v for k, v in row.items() if isinstance(v, (int, float, str))}) + "\n")
        return record

    log_line.TrainingLogger.log = logged
    load = checkpointing.Checkpointer.load

    def loaded(self):
        upcoming[0] = load(self) + 1
        return upcoming[0] - 1

    checkpointing.Checkpointer.load = loaded
    if "step" in kills or "term" in kills:
        run_schedule = step.run_schedule

        def schedule_then_die(args, *rest, **kwargs):
            out = run_schedule(args, *rest, **kwargs)
            if upcoming[0] == kills.get("step"):
                _die()
            if upcoming[0] == kills.get("term"):
                _die(signal.SIGTERM)
            return out

        step.run_schedule = schedule_then_die
    if os.environ.get("RESTART_PROBE_ONE_SAVE_IN_FLIGHT") == "1":
        save = checkpointing.Checkpointer.save

        def save_after_the_last(self, iteration, *rest, **kwargs):
            if self._queue is not None:  # collective: every rank saves at the same iteration
                self._queue.maybe_finalize_async_calls(blocking=True)
            return save(self, iteration, *rest, **kwargs)

        checkpointing.Checkpointer.save = save_after_the_last
    if "save" in kills:
        commit = checkpointing.Checkpointer._commit

        def commit_or_die(self, iteration, *rest):
            if iteration == kills["save"]:
                _die()
            return commit(self, iteration, *rest)

        checkpointing.Checkpointer._commit = commit_or_die


def main() -> None:
    records, spec, sep, *argv = sys.argv[1:]
    assert sep == "--"
    from megatron_ext import errors, platform

    platform.dump_native_crashes()
    platform.setup()
    import arguments

    install(records, _kills(spec))
    from train import main as train_main

    errors.run(lambda: train_main(argv), explain=arguments.explain)


if __name__ == "__main__":
    main()
