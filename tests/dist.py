"""Persistent distributed workers for tests: one gloo world per size, reused by every test.

Starting a process group and importing megatron-core costs seconds per process; a job on a warm
pool costs well under one. `run_distributed(world_size, "pkg.module:function", **kwargs)` runs the
function on every rank and returns the list of per-rank results (index = rank). A job that raises on
any rank fails the test with that rank's traceback; the pool is then restarted, since the other ranks
may be stuck in a collective, unless every rank reported and left nothing behind (a restart costs
every worker its start). Workers are forked from a server that has done the imports once.

Leak check: each worker records its threads, process groups and seams in place once the default
group is up; after every job (and megatron's teardown) they must be back to that baseline (no new
Python thread, process group or seam, at most THREAD_SLACK new native threads), or the job fails
naming what it left behind. A worker runs hundreds of jobs: a job that leaves a gloo group (each owns
threads) or a helper thread behind would pile up thousands.
"""
from __future__ import annotations

import atexit
import importlib
import os
import queue
import time
import traceback

DEFAULT_TIMEOUT_S = 120  # per job; no test may need more (a slow job needs a smaller workload)
THREAD_SLACK = 2  # native threads a job may leave above the baseline (lazily started process-wide pools)
SETTLE_S = 2.0  # how long a surplus may take to go away (a thread finishing after its last join)
FAILURE_GRACE_S = 2.0  # after a rank's failure, how long the others may take to report theirs

_POOLS: dict = {}


def _host_store():
    """The pool's key-value store, hosted by this process on a port the OS assigns as it binds it;
    the workers connect to it as clients (torch's env:// rendezvous with TORCHELASTIC_USE_AGENT_STORE,
    as under torchrun's agent). A port found free here and bound later by rank 0 could be taken in
    between by another test process (EADDRINUSE, measured once in a parallel run)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))


class LeakError(RuntimeError):
    pass


def _threads() -> dict:
    """Every OS thread of this process: native id -> name (the Python name where it has one)."""
    import threading

    names = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        except OSError:  # exited meanwhile
            pass
    for t in threading.enumerate():
        if t.native_id in names:
            names[t.native_id] = f"{t.name} (python)"
    return names


def _groups() -> dict:
    """Every live torch.distributed process group -> a description (name and global ranks)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return {}
    world = c10d._world
    return {
        id(pg): f"{world.pg_names.get(pg, '?')} ranks {sorted(world.pg_group_ranks.get(pg, {}))}" for pg in world.pg_map
    }


def _seams() -> set:
    """The seams in place now (megatron_ext/seams/registry.py): a run removes its own at teardown."""
    from megatron_ext.seams import registry

    return {name for name, seam in registry.SEAMS.items() if seam.active}


def snapshot(collect: bool = True) -> tuple[dict, dict, set]:
    import gc

    if collect:  # a process group or thread object only held by a reference cycle is not a leak
        gc.collect()
    return _threads(), _groups(), _seams()


def check_leaks(job: str, baseline: tuple[dict, dict, set], slack: int = THREAD_SLACK,
                settle_s: float = SETTLE_S) -> None:
    """Raise LeakError naming the surplus of `job` against `baseline`: any Python thread, process
    group or seam it left behind, or more than `slack` native threads."""
    base_threads, base_groups, base_seams = baseline
    deadline = time.monotonic() + settle_s
    collect = False  # a full collection costs more than most jobs: only once something seems left behind
    while True:
        threads, groups, seams = snapshot(collect)
        extra_groups = {k: v for k, v in groups.items() if k not in base_groups}
        extra_seams = sorted(seams - base_seams)
        new = sorted(name for tid, name in threads.items() if tid not in base_threads)
        python = [n for n in new if n.endswith("(python)")]
        surplus = len(threads) - len(base_threads)
        if not extra_groups and not extra_seams and not python and surplus <= slack:
            return
        if not collect:
            collect = True
            continue
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    lines = [f"{job} leaked:"]
    if python or surplus > slack:
        lines.append(
            f"  {surplus} threads above the baseline of {len(base_threads)} (allowed: {slack} native, no Python "
            "thread): " + ", ".join(f"{n} x{new.count(n)}" if new.count(n) > 1 else n for n in sorted(set(new)))
        )
    if extra_groups:
        lines.append(f"  {len(extra_groups)} process groups: " + "; ".join(sorted(extra_groups.values())))
    if extra_seams:
        lines.append(f"  {len(extra_seams)} seams in place: " + ", ".join(extra_seams))
    raise LeakError("\n".join(lines))


def _bound_threads() -> None:
    """One compute thread per worker process: the pools share a 2-core machine."""
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started (only possible if something ran parallel work first)
        pass


def _teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron_ext.training import parallel

        parallel.destroy()


def _worker(rank: int, world_size: int, port: int, jobs, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1",
    )
    _bound_threads()
    import torch

    from megatron_ext import platform

    platform.dump_native_crashes(rank)  # a native crash prints every thread's stack, prefixed [rank<R>]:

    platform.init_distributed(timeout_s=DEFAULT_TIMEOUT_S)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        pass  # the profiler starts its process-wide threads once: part of the baseline, not a job's leak
    results.put((rank, "ready", None, True))  # also starts the queue's feeder thread before the baseline
    baseline = snapshot()
    import gc

    gc.freeze()  # the imports' objects live as long as the worker: no collection needs to scan them
    while True:
        job = jobs.get()
        if job is None:
            break
        target, kwargs = job
        ok, payload = True, None
        try:
            module, name = target.split(":")
            payload = getattr(importlib.import_module(module), name)(**kwargs)
        except BaseException:  # noqa: BLE001 - report everything to the test
            ok, payload = False, traceback.format_exc()
        clean = True  # nothing of the job is left: the worker can take the next one
        try:
            _teardown()
            check_leaks(target, baseline, settle_s=SETTLE_S if ok else 0.0)
        except BaseException:  # noqa: BLE001
            clean = False
            if ok:
                ok, payload = False, traceback.format_exc()
        results.put((rank, ok, payload, clean))
    torch.distributed.destroy_process_group()
    results.close()
    results.join_thread()
    os._exit(0)  # skip interpreter finalisation (seconds with megatron-core loaded): nothing is left to flush


def start_server():
    """Workers fork from one server that has imported torch, megatron-core and the entry points once
    (tests/_preload.py): a fresh worker is ready in well under a second instead of the ~10 s of CPU
    those imports cost each spawned process. Returns immediately; the server imports in the
    background."""
    from bench import preload

    return preload.fork_server("tests._preload")


class JobFailed(RuntimeError):
    """A job raised on some rank, and every rank reported, tore down and left nothing behind."""


class WorkerDied(RuntimeError):
    """A worker process ended (a signal or an exit) while running a job."""


class WorkerPool:
    def __init__(self, world_size: int):
        ctx = start_server()
        self.world_size = world_size
        self.stopping = False
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.store = _host_store()  # kept while the workers live
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, self.store.port, self.jobs[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, target: str, timeout: float, kwargs: dict) -> list:
        try:
            return self._run(target, timeout, kwargs)
        except JobFailed:  # every rank reported, tore down and left nothing behind: the pool stays
            raise
        except BaseException:
            # a failed rank, a timeout, or the test interrupted (pytest-timeout): ranks may be stuck
            self.close(force=True)
            raise

    def _run(self, target: str, timeout: float, kwargs: dict) -> list:
        for q in self.jobs:
            q.put((target, kwargs))
        out, failures, clean_ranks = {}, [], 0
        deadline = time.monotonic() + timeout
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, payload, clean = self.results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise WorkerDied(f"{target}: worker process died: " + ", ".join(
                        f"rank {r} (exit code {code})" for r, code in dead))
                if time.monotonic() >= deadline:
                    break
                continue
            if ok == "ready":
                continue
            clean_ranks += clean
            if ok:
                out[rank] = payload
            else:
                failures.append((rank, payload))
                # the others report their own failures at once, or are blocked with the failed rank (the
                # pool is then restarted): a short grace picks the lowest failing rank's traceback
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        if failures:
            rank, tb = min(failures)
            failed = JobFailed if clean_ranks == self.world_size else RuntimeError
            raise failed(f"{target} failed on rank {rank} of {self.world_size}:\n{tb}")
        if len(out) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(out))
            raise TimeoutError(f"{target}: ranks {missing} gave no result within {timeout}s")
        return [out[r] for r in range(self.world_size)]

    def stop(self) -> None:
        """Ask every worker to finish (after its current job) without waiting."""
        if not self.stopping:
            self.stopping = True
            for q in self.jobs:
                q.put(None)

    def close(self, force: bool = False) -> None:
        if not force:
            self.stop()
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        if _POOLS.get(self.world_size) is self:
            _POOLS.pop(self.world_size)


def run_distributed(world_size: int, target: str, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> list:
    assert timeout <= DEFAULT_TIMEOUT_S, f"{target}: a job may not need more than {DEFAULT_TIMEOUT_S}s"
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool.run(target, timeout, kwargs)


@atexit.register
def close_all() -> None:
    pools = list(_POOLS.values())
    for pool in pools:  # all pools wind down at once
        pool.stop()
    for pool in pools:
        pool.close()
