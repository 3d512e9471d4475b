"""Streams and events behind one small interface, with a CPU stand-in.

On CUDA these are real ``torch.cuda`` streams/events; on CPU every operation is already ordered,
so the stand-ins are no-ops. Scheduling code (offload, overlap) is written once against this.
"""
from __future__ import annotations

import contextlib

import torch


def cuda() -> bool:
    return torch.cuda.is_available()


class Event:
    def __init__(self):
        self._event = torch.cuda.Event() if cuda() else None
        self.recorded = False

    def record(self, stream=None) -> "Event":
        if self._event is not None:
            self._event.record(stream.raw if stream is not None else None)
        self.recorded = True
        return self

    def wait(self, stream=None) -> None:
        """Make `stream` (default: current) wait for this event, without blocking the host."""
        if self._event is not None:
            self._event.wait(stream.raw if stream is not None else None)

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class Stream:
    def __init__(self, priority: int = 0, raw=None):
        self.raw = raw if raw is not None else (torch.cuda.Stream(priority=priority) if cuda() else None)

    @classmethod
    def current(cls) -> "Stream":
        return cls(raw=torch.cuda.current_stream()) if cuda() else cls()

    def context(self):
        return torch.cuda.stream(self.raw) if self.raw is not None else contextlib.nullcontext()

    def wait(self, other: "Stream") -> None:
        if self.raw is not None:
            self.raw.wait_stream(other.raw)

    def record(self) -> Event:
        return Event().record(self)


def pin_memory_available() -> bool:
    return cuda()
