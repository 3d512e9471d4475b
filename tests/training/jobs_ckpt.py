"""Checkpointing job functions, run on every rank of a persistent gloo world (see tests/dist.py)."""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os


@contextlib.contextmanager
def _may_start_processes():
    """The pool's workers are daemonic, and multiprocessing refuses to start children from a
    daemonic process; --async-save forks a writer process per save. Lifted for the job only."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def train(argv: list[str]) -> list[dict]:
    import train as entry

    with _may_start_processes():
        return entry.main(argv)


def train_with_crash_mid_save(argv: list[str], save_dir: str, crash_iteration: int, how: str) -> dict:
    """Run train.main(argv) with the checkpoint writer failing while it writes the checkpoint of
    `crash_iteration`, after its first item is on disk.

    how="raise": the write raises (an I/O error), inside megatron-core's writer.
    how="exit":  the writing process dies on the spot (os._exit); with --async-save that is the
                 forked writer process, so the trainer survives to see the failure.
    Returns what the run raised and what is on disk afterwards."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.api import CheckpointException

    original = filesystem_async._write_item
    target = f"iter_{crash_iteration:07d}"

    @functools.wraps(original)  # megatron inspects its signature (filesystem_async.py:390)
    def failing_write_item(*args, **kwargs):
        result = original(*args, **kwargs)
        stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
        if target in str(stream.name):
            stream.flush()
            if how == "exit":
                os._exit(17)
            raise OSError(f"injected failure while writing {stream.name}")
        return result

    filesystem_async._write_item = failing_write_item
    error = None
    try:
        import train as entry

        with _may_start_processes():
            entry.main(argv)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    finally:
        filesystem_async._write_item = original
        from megatron_ext.training import parallel

        parallel.destroy()
    partial = os.path.join(save_dir, target + ".partial")
    return {
        "error": error,
        "listing": sorted(os.listdir(save_dir)),
        "partial_files": sorted(os.listdir(partial)) if os.path.isdir(partial) else None,
    }
