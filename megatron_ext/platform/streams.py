"""Streams and events behind one small interface, with a CPU stand-in.

On CUDA these are real ``torch.cuda`` streams/events; on CPU every operation is already ordered,
so the stand-ins are no-ops. Scheduling code (offload, overlap) is written once against this.

``Stream(deferred=True)`` on CPU models a device queue for tests: work given to ``Stream.run`` is
queued and runs only when an event recorded after it is waited on, synchronized or queried (as late
as a real device could run it). Code that reads a copy's result without ordering on its event sees
stale data there, so missing waits fail on a CPU-only machine. ``host_empty`` allocates host
staging memory (pinned on CUDA).
"""
from __future__ import annotations

import contextlib

import torch


def cuda() -> bool:
    return torch.cuda.is_available()


class _DeferredQueue:
    """CPU model of one device queue: callables run in order, only when something waits for them."""

    def __init__(self):
        self.ops: list = []
        self.done = 0

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            op, self.ops[self.done] = self.ops[self.done], None  # run once, then let go of it
            self.done += 1
            op()


class Event:
    def __init__(self):
        self._event = torch.cuda.Event() if cuda() else None
        self.recorded = False
        self._mark = None  # (deferred queue, position) on CPU

    def record(self, stream=None) -> "Event":
        if self._event is not None:
            self._event.record(stream.raw if stream is not None else None)
        elif stream is not None and stream.queue is not None:
            self._mark = (stream.queue, len(stream.queue.ops))
        self.recorded = True
        return self

    def _flush(self) -> None:
        if self._mark is not None:
            queue, mark = self._mark
            queue.run_until(mark)

    def wait(self, stream=None) -> None:
        """Make `stream` (default: current) wait for this event, without blocking the host."""
        if self._event is not None:
            self._event.wait(stream.raw if stream is not None else None)
        elif stream is not None and stream.queue is not None:
            stream.queue.ops.append(self._flush)  # the waiting queue's later work runs after it
        else:
            self._flush()

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        else:
            self._flush()

    def query(self) -> bool:
        """True once the work before the event has run (a deferred CPU queue runs it now)."""
        if self._event is not None:
            return self._event.query()
        self._flush()
        return True


class Stream:
    def __init__(self, priority: int = 0, raw=None, deferred: bool = False):
        self.raw = raw if raw is not None else (torch.cuda.Stream(priority=priority) if cuda() else None)
        self.queue = _DeferredQueue() if (deferred and self.raw is None) else None

    @classmethod
    def current(cls) -> "Stream":
        return cls(raw=torch.cuda.current_stream()) if cuda() else cls()

    def context(self):
        return torch.cuda.stream(self.raw) if self.raw is not None else contextlib.nullcontext()

    def wait(self, other: "Stream") -> None:
        if self.raw is not None:
            self.raw.wait_stream(other.raw)
        elif other.queue is not None:
            other.record().wait(self)

    def run(self, fn) -> None:
        """Issue `fn`'s device work on this stream (queued on a deferred CPU stream)."""
        if self.queue is not None:
            self.queue.ops.append(fn)
        else:
            with self.context():
                fn()

    def synchronize(self) -> None:
        if self.raw is not None:
            self.raw.synchronize()
        elif self.queue is not None:
            self.queue.run_until(len(self.queue.ops))

    def record(self) -> Event:
        return Event().record(self)


def pin_memory_available() -> bool:
    return cuda()


def host_empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 host buffer for device<->host staging: pinned on CUDA (async copies need it)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, device="cpu", pin_memory=pin_memory_available())
