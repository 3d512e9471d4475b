"""Run one function on every rank of a fresh world of local processes (gloo on CPU, NCCL with CUDA),
for the benchmark scripts. The test suite keeps persistent worker pools of its own (tests/dist.py).

    results = run_world(2, measure, argv=[...])     # one result per rank, index = rank

Each worker sets the platform up and joins the default process group before it imports the
function's module, so that module may import megatron-core at the top. Workers print to stderr: a
benchmark's stdout stays free for its JSON.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, target: str, kwargs: dict, results) -> None:
    os.dup2(2, 1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch  # after the environment above: its thread pools read OMP_NUM_THREADS

    from megatron_ext import platform

    torch.set_num_threads(1)
    platform.init_distributed()
    try:
        module, name = target.split(":")
        results.put((rank, True, getattr(importlib.import_module(module), name)(**kwargs)))
    except BaseException:  # noqa: BLE001 - reported to the caller with the rank
        results.put((rank, False, traceback.format_exc()))
    finally:
        torch.distributed.destroy_process_group()


def run_world(world_size: int, fn: Callable, timeout: float = 900, **kwargs) -> list:
    """fn(**kwargs) on every rank; fn is a module-level function (of a script's __main__ too)."""
    target = f"{fn.__module__}:{fn.__qualname__}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, target, kwargs, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"{target}: rank {dead[0]} of {world_size} died (exit code "
                                       f"{procs[dead[0]].exitcode}; its output is above)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{target}: no result from ranks {sorted(set(range(world_size)) - set(out))} "
                                       f"within {timeout}s") from None
                continue
            if not ok:
                raise RuntimeError(f"{target} failed on rank {rank} of {world_size}:\n{payload}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30 if len(out) == world_size else 0)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
