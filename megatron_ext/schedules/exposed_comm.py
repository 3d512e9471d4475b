"""The time the compute waits for the paired passes' TP (and EP, CP) collectives, per group kind, for
the log line (schedules/__init__.py log_counters): host time on CPU; on CUDA, where NCCL's wait() only
makes the current stream wait, CUDA events around it on that stream, read when the log line asks."""
from __future__ import annotations

import time

import torch


EXPOSED_S: dict = {}
_PENDING_EVENTS: list = []


def timed_wait(work, kind: str):
    """work.wait(), timed. Returns (host t0, host t1, (event0, event1) on CUDA else None)."""
    events = None
    if torch.cuda.is_available():
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    t0 = time.perf_counter()
    work.wait()
    t1 = time.perf_counter()
    if events is not None:
        events[1].record()
        _PENDING_EVENTS.append((kind, events))
    else:
        EXPOSED_S[kind] = EXPOSED_S.get(kind, 0.0) + (t1 - t0)
    return t0, t1, events


def exposed_seconds() -> dict:
    """EXPOSED_S with the CUDA-event intervals recorded so far added (waits for them)."""
    while _PENDING_EVENTS:
        kind, (e0, e1) = _PENDING_EVENTS.pop()
        e1.synchronize()
        EXPOSED_S[kind] = EXPOSED_S.get(kind, 0.0) + e0.elapsed_time(e1) / 1e3
    return EXPOSED_S
