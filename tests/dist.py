"""Persistent distributed workers for tests: one gloo world per size, reused by every test.

Starting a process group and importing megatron-core costs seconds per process; a job on a warm
pool costs well under one. `run_distributed(world_size, "pkg.module:function", **kwargs)` runs the
function on every rank and returns the list of per-rank results (index = rank). A job that raises on
any rank fails the test with that rank's traceback; the pool is then restarted, since the other ranks
may be stuck in a collective.
"""
from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import queue
import socket
import traceback

_POOLS: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, jobs, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    from megatron_ext import platform

    platform.init_distributed(timeout_s=120)
    while True:
        job = jobs.get()
        if job is None:
            break
        target, kwargs = job
        try:
            module, name = target.split(":")
            result = getattr(importlib.import_module(module), name)(**kwargs)
            results.put((rank, True, result))
        except BaseException:  # noqa: BLE001 - report everything to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                from megatron_ext.training import parallel

                parallel.destroy()
    torch.distributed.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.jobs[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, target: str, timeout: float, kwargs: dict) -> list:
        for q in self.jobs:
            q.put((target, kwargs))
        out, failures = {}, []
        wait = timeout
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, payload = self.results.get(timeout=wait)
            except queue.Empty:
                break
            if ok:
                out[rank] = payload
            else:
                failures.append((rank, payload))
                wait = 10  # others may be blocked in a collective with the failed rank
        if failures or len(out) < self.world_size:
            self.close(force=True)
            if failures:
                rank, tb = failures[0]
                raise RuntimeError(f"{target} failed on rank {rank} of {self.world_size}:\n{tb}")
            missing = sorted(set(range(self.world_size)) - set(out))
            raise TimeoutError(f"{target}: ranks {missing} gave no result within {timeout}s")
        return [out[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        _POOLS.pop(self.world_size, None) if _POOLS.get(self.world_size) is self else None


def run_distributed(world_size: int, target: str, timeout: float = 300, **kwargs) -> list:
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool.run(target, timeout, kwargs)


@atexit.register
def close_all() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
