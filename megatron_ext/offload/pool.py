"""A bounded, reusable host pool of fixed-size chunks (pinned on CUDA).

Host memory of ``capacity_bytes`` allocated once, cut into ``chunk_bytes`` slots. A tensor's bytes
move through as many slots as it needs; when too few are free the caller keeps the tensor on the
device. A slot comes back with a fence, the event that ends the last copy out of it; whoever takes it
makes its own stream wait for that fence before writing it (stream order, no host poll).

The memory is allocated in segments of at most ``SEGMENT_BYTES``: torch's pinned-memory allocator
rounds every allocation up to a power of two (ATen/core/CachingHostAllocator.h, ``allocate``), so one
allocation of a 9.9 GB pool pins 16 GiB of host memory; segments waste less than one segment.
"""
from __future__ import annotations

from megatron_ext.platform import streams

POISON = 0xFF  # every float format reads 0xFF..FF as NaN
SEGMENT_BYTES = 1 << 30


class HostPool:
    def __init__(self, capacity_bytes: int, chunk_bytes: int, debug: bool = False):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = int(chunk_bytes)
        self.num_slots = int(capacity_bytes) // self.chunk_bytes
        self.debug = debug
        per_segment = max(1, SEGMENT_BYTES // self.chunk_bytes)
        self.segments = [streams.host_empty(min(per_segment, self.num_slots - i) * self.chunk_bytes)
                         for i in range(0, self.num_slots, per_segment)]
        # debug: a slot is poisoned before its first use rather than the whole buffer up front (the
        # default pool is 1 GiB: filling it cost ~0.7 s and its memory per run on CPU). A slot is read
        # only after it is taken, so it reads the same NaN bytes either way.
        self._unpoisoned = set(range(self.num_slots)) if debug else set()
        self.slots = [seg[j * self.chunk_bytes : (j + 1) * self.chunk_bytes]
                      for seg in self.segments for j in range(seg.numel() // self.chunk_bytes)]
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._fence = [None] * self.num_slots
        self.high_water = 0

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.chunk_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def slots_for(self, nbytes: int) -> int:
        return -(-int(nbytes) // self.chunk_bytes)

    def take(self, nbytes: int) -> list[int] | None:
        """Slot ids covering `nbytes`, or None if the pool cannot hold it now."""
        need = self.slots_for(nbytes)
        if need > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(need)]
        first = self._unpoisoned.intersection(ids)
        if first:
            self.poison(sorted(first))
            self._unpoisoned -= first
        self.high_water = max(self.high_water, self.num_slots - len(self._free))
        return ids

    def give(self, ids: list[int], fence=None) -> None:
        """Free these slots. ``fence``: the event after the last copy out of them (None: none in
        flight; then a debug pool poisons them at once)."""
        for i in ids:
            if self.debug and fence is None:
                self.slots[i].fill_(POISON)
            self._fence[i] = fence
            self._free.append(i)

    def fences(self, ids: list[int]) -> list:
        """The distinct fences of freshly taken slots that a writer must wait for (then forgotten)."""
        out = []
        for i in ids:
            f, self._fence[i] = self._fence[i], None
            if f is not None and all(f is not g for g in out) and not f.query():
                out.append(f)
        return out

    def poison(self, ids: list[int]) -> None:
        for i in ids:
            self.slots[i].fill_(POISON)

    def storage_ptrs(self) -> set:
        return {seg.untyped_storage().data_ptr() for seg in self.segments}
