"""Jobs for tests/test_dist.py: the worker pool's own behaviour (see tests/dist.py)."""
from __future__ import annotations

import os
import threading

_KEPT: list = []


def leak_thread() -> int:
    """Start a helper thread and return without stopping it (what the leak check must catch)."""
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="deliberately-leaked-helper", daemon=True).start()
    _KEPT.append(stop)
    return 1


def leak_process_group() -> int:
    """Create a process group outside parallel.initialize and keep it."""
    import torch.distributed as dist

    _KEPT.append(dist.new_group(list(range(dist.get_world_size())), group_desc="deliberately_leaked"))
    return 1


def join_thread() -> int:
    """A helper thread that is joined before the job returns leaves nothing behind."""
    done = []
    t = threading.Thread(target=lambda: done.append(1), name="joined-helper")
    t.start()
    t.join()
    return len(done)


def worker_pid() -> int:
    import os

    return os.getpid()


def die(code: int) -> None:
    os._exit(code)


def preloaded() -> list:
    """What of the fork server's preload this worker started with (nothing before the job imports it)."""
    import sys

    modules = ("tests._preload", "train", "arguments", "megatron.training.training")
    return sorted(m for m in modules if m in sys.modules)


def raise_on(rank: int, leak: bool = False) -> int:
    """Raise on ``rank`` (after leaving a thread behind, with ``leak``); the other ranks return."""
    import torch.distributed as dist

    if dist.get_rank() == rank:
        if leak:
            leak_thread()
        raise ValueError("deliberately failed")
    return 1


def leave_a_seam() -> int:
    """Put a recorded seam in place and return without removing it."""
    from megatron_ext.seams import registry

    registry.apply_for_run(next(seam for seam in registry.SEAMS.values() if not seam.active))
    return 1
