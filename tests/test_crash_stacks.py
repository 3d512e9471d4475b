"""A native crash in a test worker (tests/dist.py) or a train.py rank prints every thread's Python
stack, each line prefixed with the rank (platform.dump_native_crashes)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def segfault(rank: int) -> None:
    """The job: `rank` dereferences a null pointer; the other ranks return."""
    import ctypes
    import threading

    import torch

    if torch.distributed.get_rank() == rank:
        threading.Thread(target=threading.Event().wait, name="bystander", daemon=True).start()
        ctypes.string_at(0)


# the suite's pool and workers; their fork server preloads the platform alone (the job needs no more,
# and a server already running is the one the pool uses): seconds of imports fewer than the suite's
POOL = """
from bench import preload
preload.fork_server("megatron_ext.platform")
from tests.dist import run_distributed
try:
    run_distributed(2, "tests.test_crash_stacks:segfault", timeout=60, rank=1)
except RuntimeError as e:
    print("pool:", e)
"""


def test_a_segfaulting_worker_prints_every_threads_stack_prefixed_with_its_rank():
    # the suite's path (pytest.ini): scripts/ for scripts/bench/preload.py, which starts the fork server
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", POOL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert "pool: tests.test_crash_stacks:segfault: worker process died: rank 1 (exit code -11)" in done.stdout, \
        done.stdout + done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("[rank1]: ")]
    text = "\n".join(lines)
    assert "[rank1]: Fatal Python error: Segmentation fault" in text, done.stderr[-3000:]
    # the crashing thread, down to the line of this file that crashed, and the other threads too
    assert "[rank1]: Current thread 0x" in text
    assert f'[rank1]:   File "{__file__}", line ' in text and " in segfault" in text
    assert text.count("[rank1]: Thread 0x") >= 1
    assert not any(line.startswith("[rank0]: Fatal") for line in done.stderr.splitlines())
