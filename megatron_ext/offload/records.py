"""What the offload engine keeps, and the states it moves them through (``manager.py`` tells the
life of a group): a record per device storage a group saved, a group per layer per pass, a pass per
forward call of one model chunk. The hooks create them; the engine moves their bytes."""
from __future__ import annotations

import weakref

# record states
PACKED, KEPT, COPYING, OFFLOADED, RELOADING = "packed", "kept", "copying", "offloaded", "reloading"


class Record:
    """One device storage saved by a group."""

    __slots__ = ("storage", "nbytes", "device", "slots", "state", "d2h_event", "h2d_event", "reloaded",
                 "waited", "group", "module", "__weakref__")

    def __init__(self, storage, device, group, module=None):
        self.storage = storage
        self.module = module  # (offload module name, the hooked sub-module's path in its layer)
        self.nbytes = storage.nbytes()
        self.device = device
        self.slots = None
        self.state = PACKED
        self.d2h_event = self.h2d_event = self.reloaded = None
        self.waited = False
        self.group = weakref.ref(group)


class Pass:
    """One forward call of one model chunk (one micro-batch): its groups in forward order."""

    __slots__ = ("chunk", "index", "groups", "listed", "started")

    def __init__(self, chunk, index):
        self.chunk, self.index, self.groups = chunk, index, []
        self.listed = self.started = False


class Group:
    """What one layer of one pass saved for backward: its records, by data pointer."""

    __slots__ = ("key", "records", "state", "pass_", "__weakref__")

    def __init__(self, key, pass_):
        self.key, self.records, self.state, self.pass_ = key, {}, "forward", pass_

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values()) if self.records else 0

