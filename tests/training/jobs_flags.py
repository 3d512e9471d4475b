"""Jobs for the Megatron flag-family tests, run on every rank of a persistent gloo world (tests/dist.py)."""
from __future__ import annotations

import contextlib
import io


def train_capture(argv: list[str]) -> dict:
    """train.main(argv); its history and what it printed on this rank."""
    import train as entry

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = entry.main(argv)
    return {"history": history, "stdout": out.getvalue()}


def train_calling_at_each_log(argv: list[str], on_log) -> list[dict]:
    """train.main(argv) with on_log(iteration) called as each iteration's log line is written."""
    import train as entry
    from megatron_ext.training import log_line as log

    original = log.TrainingLogger.log

    def logged(self, iteration, result, lr, extra=None):
        on_log(iteration)
        return original(self, iteration, result, lr, extra)

    log.TrainingLogger.log = logged
    try:
        return entry.main(argv)
    finally:
        log.TrainingLogger.log = original


def parse_error(argv: list[str]) -> str | None:
    """The ConfigError (one line) that parsing argv raises on this rank, if any."""
    import arguments
    from megatron_ext.errors import ConfigError

    try:
        arguments.parse(argv, exit_on_dry_run=False)
    except ConfigError as e:
        return str(e)
    return None


def train_with_signal(argv: list[str], at: int) -> dict:
    """Rank 0 sends itself SIGTERM during iteration `at`; the run must stop there on every rank."""
    import os
    import signal

    import torch

    before = signal.getsignal(signal.SIGTERM)

    def on_log(iteration):
        if iteration == at and torch.distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    history = train_calling_at_each_log(argv, on_log)
    return {"iterations": [r["iteration"] for r in history], "handler_restored": signal.getsignal(signal.SIGTERM) is before}


def train_started_minutes_ago(argv: list[str], minutes: float) -> list[int]:
    """As if the program had started `minutes` ago (megatron's _TRAIN_START_TIME)."""
    import time

    from megatron.training import training

    import train as entry

    saved = training._TRAIN_START_TIME
    training.set_startup_timestamps(program_start=time.time() - 60 * minutes)
    try:
        return [r["iteration"] for r in entry.main(argv)]
    finally:
        training._TRAIN_START_TIME = saved


def train_watching_gc(argv: list[str]) -> dict:
    """Whether automatic gc was on during the iterations, and the full collections made meanwhile."""
    import gc

    seen, full = [], {"n": 0}

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full["n"] += 1

    gc.callbacks.append(count)
    try:
        train_calling_at_each_log(argv, lambda _iteration: seen.append(gc.isenabled()))
    finally:
        gc.callbacks.remove(count)
    return {"enabled_during": seen, "full_collections": full["n"], "enabled_after": gc.isenabled()}


def train_with_fake_wandb(argv: list[str]) -> dict:
    """A stand-in `wandb` module records what megatron's W&B writer is asked to do."""
    import importlib.machinery
    import sys
    import types

    import train as entry

    calls = {"init": [], "log": [], "finish": 0}
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls["init"].append({k: kw[k] for k in ("project", "name", "dir")})
    fake.log = lambda data, step=None: calls["log"].append((step, sorted(data)))
    fake.finish = lambda: calls.__setitem__("finish", calls["finish"] + 1)
    sys.modules["wandb"] = fake
    try:
        entry.main(argv)
    finally:
        del sys.modules["wandb"]
    return calls


def train_outside_daemon(argv: list[str]) -> dict:
    """train.main as in a launcher's process: allowed to start data-loader workers (pool workers are
    daemonic, and Python refuses children to daemonic processes) with Linux's default start method
    (pool workers inherit 'spawn', which cannot pickle megatron's worker_init_fn).
    Returns the losses and the most child processes seen during an iteration."""
    import multiprocessing

    config = multiprocessing.current_process()._config
    daemon, config["daemon"] = config.get("daemon"), False
    method = multiprocessing.get_start_method()
    multiprocessing.set_start_method("fork", force=True)
    children = {"n": 0}

    def on_log(iteration):
        children["n"] = max(children["n"], len(multiprocessing.active_children()))

    try:
        history = train_calling_at_each_log(argv, on_log)
    finally:
        config["daemon"] = daemon
        multiprocessing.set_start_method(method, force=True)
    return {"losses": [r["lm loss"] for r in history], "children": children["n"]}
