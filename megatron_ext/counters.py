"""Counters for the log line, shared by every capability package (it imports nothing of ours)."""
from __future__ import annotations

import weakref


class SinceLastCall:
    """Running totals -> how much each grew since the previous call (a log line reports its own
    interval). A new `run` (an object identifying it, held weakly so that a finished run can be
    freed) starts again from zero."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._last, self._run = {}, None

    def __call__(self, totals: dict, run=None) -> dict:
        if (self._run() if self._run is not None else None) is not run:
            self._last, self._run = {}, (weakref.ref(run) if run is not None else None)
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items()}
        self._last = dict(totals)
        return delta
