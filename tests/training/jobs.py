"""Job functions run on every rank of a persistent gloo world (see tests/dist.py)."""
from __future__ import annotations


def train(argv: list[str]) -> list[dict]:
    import train as entry

    return entry.main(argv)


def layout_cycle(cycles: int) -> dict:
    """Initialise and destroy a TP2 layout `cycles` times; report what survives."""
    import threading

    from torch.distributed import distributed_c10d as c10d

    from megatron_ext.training import parallel

    for _ in range(cycles):
        parallel.initialize(tensor=2)
        parallel.destroy()
    return {"groups_after": len(c10d._world.pg_map), "threads_after": _native_threads()}


def _native_threads() -> int:
    import os

    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def train_with_counters(argv: list[str]) -> dict:
    """Run train.main and return the feature counters of the last log line, as the log shows them."""
    import train as entry
    from megatron_ext.training import log_line as log

    shown = {}
    original = log.TrainingLogger.format

    def capture(self, record):
        shown.update({k: v for k, v in record.items() if k not in log._CORE_KEYS})
        return original(self, record)

    log.TrainingLogger.format = capture
    try:
        entry.main(argv)
    finally:
        log.TrainingLogger.format = original
    return shown
