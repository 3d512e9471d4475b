"""What the sections of ``scripts/gpu_check.py`` measure with: CUDA-event timing, counted or
refused host-device synchronisations, and the claim list each section appends to."""
from __future__ import annotations

import contextlib
import os
import socket
import statistics
import sys
import warnings

import torch


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_CUDA = "skipped: no CUDA"


def cuda() -> bool:
    return torch.cuda.is_available()


def sync():
    if cuda():
        torch.cuda.synchronize()


def interleaved_ms(fns, reps: int) -> list:
    """Per fn: {"median", "min", "max"} device ms (CUDA events) over ``reps`` rounds that run every fn
    once in turn (after one warm-up each), so drift affects them alike."""
    if not cuda():
        return [NO_CUDA] * len(fns)
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
    return [{"median": round(statistics.median(ts), 4), "min": round(min(ts), 4), "max": round(max(ts), 4)}
            for ts in times]


def timed_ms(fn, reps: int) -> float | str:
    """Median device time of fn (CUDA events), after one warm-up call."""
    (times,) = interleaved_ms([fn], reps)
    return times if times == NO_CUDA else times["median"]


@contextlib.contextmanager
def sync_watch(mode: str):
    """torch.cuda.set_sync_debug_mode(mode) over the block; the explicit waits (Event/Stream
    .synchronize, torch.cuda.synchronize: megatron's dropless alltoall waits on an event,
    token_dispatcher.py:950) are counted ("warn") or refused ("error") here, each exactly once,
    since torch's mode does not report every one of them."""
    explicit = []
    restore = []

    def watch(owner, name):
        original = getattr(owner, name)

        def waiting(*a, **k):
            if mode == "error":
                raise RuntimeError(f"called a synchronizing CUDA operation ({owner.__name__}.{name})")
            explicit.append(name)
            torch.cuda.set_sync_debug_mode("default")  # counted here, once, whether or not torch warns
            try:
                return original(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

        setattr(owner, name, waiting)
        restore.append((owner, name, original))

    sync()
    for owner, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")):
        watch(owner, name)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield lambda: len(explicit) + sum(1 for w in seen if "synchroniz" in str(w.message))
        finally:
            torch.cuda.set_sync_debug_mode("default")
            for owner, name, original in reversed(restore):
                setattr(owner, name, original)


def count_cuda_syncs(fn):
    """(host-device synchronisations fn performs on CUDA, fn's result); (NO_CUDA, result) on CPU."""
    if not cuda():
        return NO_CUDA, fn()
    with sync_watch("warn") as count:
        result = fn()
        return count(), result


def sync_free(fn) -> bool | str:
    """True if fn runs with every synchronisation raising (set_sync_debug_mode("error") and the
    explicit waits)."""
    if not cuda():
        return NO_CUDA
    try:
        with sync_watch("error"):
            fn()
        return True
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        return False


def package_version(dist: str):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def claim(claims: list, text: str, holds) -> None:
    """holds: True / False, or a "skipped: ..." string."""
    claims.append({"claim": text, "holds": holds})


@contextlib.contextmanager
def stdout_to_stderr():
    """While a section runs, everything written to stdout (megatron's log handlers, train.py's log
    lines) goes to stderr: the harness's stdout carries only the final tables."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def single_process_env():
    """A world of one process for megatron's process groups; the caller's environment comes back."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    for key, value in zip(keys, ("0", "0", "1", "127.0.0.1", port)):
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
