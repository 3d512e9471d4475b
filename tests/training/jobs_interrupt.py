"""Jobs for the interrupt tests, run on every rank of a persistent gloo world (tests/dist.py)."""
from __future__ import annotations


def train_signalled(argv: list[str], rank: int, at: int) -> dict:
    """train.main(argv) with `rank` sending itself SIGTERM during iteration `at` (as a scheduler
    signals one process): the iterations this rank ran, what it printed, and whether the previous
    SIGTERM and SIGINT handlers are back."""
    import contextlib
    import io
    import os
    import signal

    import torch

    import train as entry
    from megatron_ext.training import log_line as log

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    original = log.TrainingLogger.log

    def logged(self, iteration, result, lr, extra=None):
        if iteration == at and torch.distributed.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, iteration, result, lr, extra)

    out = io.StringIO()
    log.TrainingLogger.log = logged
    try:
        with contextlib.redirect_stdout(out):
            history = entry.main(argv)
    finally:
        log.TrainingLogger.log = original
    return {"iterations": [r["iteration"] for r in history], "stdout": out.getvalue(),
            "handlers_restored": all(signal.getsignal(s) is h for s, h in before.items())}


def train_history(argv: list[str]) -> list[tuple]:
    """train.main(argv): (iteration, lm loss, grad norm) of each iteration, on this rank."""
    import contextlib
    import io

    import train as entry

    with contextlib.redirect_stdout(io.StringIO()):
        history = entry.main(argv)
    return [(r["iteration"], float(r["lm loss"]), r["grad norm"]) for r in history]
