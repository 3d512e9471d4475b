"""The backward-order predictor: which forward pass runs backward next, learnt from the previous
"epoch" (a stretch of steps until no forwarded pass waits for backward), so that prefetch can cross
from one pass into the next and a pass's last copy is issued early when another pass comes next.

Observed: the passes waiting for backward (forward order); for each pass that started backward in
this epoch, its index among those not started yet. The previous epoch's log predicts the next pass
to run backward. The event sequence ("F" a pass forwarded, "B" a pass started backward) tells whether
the next thing after a forward pass or a finished backward pass is a backward (only then is a
cross-pass prefetch issued, so a prefetched layer never waits through a whole forward).

A pass is anything with ``groups`` (those not yet reached by backward) and the flags ``listed`` /
``started`` (``records.Pass``); no torch here.
"""
from __future__ import annotations


class BackwardOrder:
    def __init__(self):
        self.outstanding: list = []  # passes waiting for backward, in forward order
        self.epoch_log: list = []
        self.prev_log: list = []
        self.events: list = []
        self.prev_events: list = []

    def forwarded(self, pass_) -> None:
        """A layer of the pass finished forward with something to give back: the pass now waits
        for backward (counted once)."""
        if not pass_.listed:
            pass_.listed = True
            self.outstanding.append(pass_)
            self.events.append("F")

    def backward_started(self, pass_) -> None:
        if not pass_.started and pass_ in self.outstanding:
            waiting = [p for p in self.outstanding if not p.started]
            self.epoch_log.append(waiting.index(pass_))
            self.events.append("B")
            pass_.started = True

    def backward_done(self, pass_) -> None:
        """Backward reached the pass's last waiting group."""
        if pass_ in self.outstanding:
            self.outstanding.remove(pass_)
            if not self.outstanding:  # every forwarded pass is back-propagated: an epoch ends
                self.prev_log, self.epoch_log = self.epoch_log, []
                self.prev_events, self.events = self.events, []

    def last_was_forward(self) -> bool:
        return bool(self.events) and self.events[-1] == "F"

    def other_comes_next(self, pass_) -> bool:
        """As in the last epoch, what follows this forward is a forward or another pass's backward
        (no prediction in the first epoch: False)."""
        n = len(self.events)
        if n >= len(self.prev_events) or self.prev_events[:n] != self.events:
            return False
        if self.prev_events[n] == "F":
            return True
        nxt = self.predict_next_pass(None)
        return nxt is not None and nxt is not pass_

    def next_is_backward(self) -> bool:
        n = len(self.events)
        return n < len(self.prev_events) and self.prev_events[:n] == self.events and self.prev_events[n] == "B"

    def predict_next_pass(self, current):
        k = len(self.epoch_log)
        if k >= len(self.prev_log):
            return None
        waiting = [p for p in self.outstanding if not p.started and p is not current]
        j = self.prev_log[k]
        return waiting[j] if j < len(waiting) else None
