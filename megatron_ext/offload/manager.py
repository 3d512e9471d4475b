"""Chunked, race-free activation offload.

What is offloaded: every tensor that a chosen module saves for backward (through
``torch.autograd.graph`` saved-tensor hooks pushed around that module's forward), grouped per
transformer layer per micro-batch per model chunk: key = (chunk, pass, layer_number), where a pass is
one forward call of one model chunk (one micro-batch).

Life of a group (one layer of one micro-batch)::

    forward ──► pending ──(next group starts its forward, or another pass starts backward)──►
    offloading (D2H on the d2h stream, device storage still held) ──(D2H event done)──►
    offloaded (device storage released; bytes live only in pool slots) ──(prefetch / on demand)──►
    reloading (H2D on the h2d stream into a buffer allocated on the compute stream) ──► consumed

- The D2H copy of a group is issued one group late. If the group's own backward begins first (the
  last layer before a backward: PP=1, the last PP stage, the last virtual chunk), the group is never
  copied at all: it was going to be needed at once, so offloading it cannot lower the peak.
- Release in stream order, never on a host poll. The hooks are the clock: a layer's forward start
  and end, a chunk's forward end and every layer's backward start are ticks. A group whose D2H was
  issued at one tick is released at the next one: the compute stream waits for its copy-done event,
  then the device storage is dropped. The caching allocator hands that block only to later work of
  the compute stream, which is ordered after the copy, so the bytes come free at once whatever the
  host sees. In forward, layer i-1's copy is issued when layer i starts and waited for when layer i
  ends: it overlaps one layer of compute, and when the link is slower than that the compute stream
  stalls (``stats['exposed_copy_s']``, measured on the CPU model; on CUDA the step time shows it).
- Race freedom by construction, with no ``record_stream``: (1) the D2H stream waits for an event
  recorded on the compute stream; (2) the device storage is dropped only after the compute stream
  waited for the D2H event; a group is reloaded from the host only after that release, so a reload
  never reads a slot before its D2H copy finished (Megatron-LM #7398); a group whose D2H is still in
  flight is served from its device storage instead; (3) the reload buffer is allocated on the compute
  stream and the H2D stream waits for an event recorded after that allocation; the compute stream
  waits for the H2D event before the tensor is handed to autograd; (4) a pool slot comes back with
  the event of the last copy out of it, and the D2H stream waits for that event before it writes the
  slot again.
- A storage is offloaded only if nothing else holds it when the copy is issued (C++ use count and
  Python references, see ``_solely_ours``), so releasing it really frees device memory; otherwise it
  stays (counted).
- Debug mode: released storages, free pool slots and not-yet-filled reload buffers are filled with NaN
  bytes and released storages are resized to 0; on CPU the two copy streams are deferred
  (``streams.Stream(deferred=True)``: they run as late as a device could), so a missing wait or an
  early release gives NaN or an error instead of silently right or wrong numbers.

Here: the engine (the pool, the two copy streams, offload / release / reload of a group). Beside it:
``records.py`` (what a record, a group and a pass hold), ``hooks.py`` (the module, saved-tensor and
backward hooks that drive the engine), ``predictor.py`` (which pass runs backward next),
``vocabulary.py`` (the module names and ``OffloadOptions``, the flags' one declaration).
"""
from __future__ import annotations

import functools
import sys
import time

import torch

from megatron_ext.offload.hooks import Hooks
from megatron_ext.offload.pool import POISON, HostPool
from megatron_ext.offload.predictor import BackwardOrder
from megatron_ext.offload.records import COPYING, KEPT, OFFLOADED, PACKED, RELOADING, Group, Pass
from megatron_ext.offload.vocabulary import OffloadOptions
from megatron_ext.platform import streams


def _bytes_view(storage, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _solely_ours(rec) -> bool:
    """Nothing but this record holds the storage: no tensor (the C++ use count is 1, the Python
    storage object's own reference) and no other Python reference to that object. torch hands out
    one Python object per storage, so another group's record of the same storage (the attention
    mask, saved by every layer) shows up only in the Python reference count (here: the record's
    slot and getrefcount's argument)."""
    return _use_count(rec.storage) == 1 and sys.getrefcount(rec.storage) == 2


STAT_KEYS = (
    "offloaded_bytes", "reloaded_bytes", "prefetched_groups", "on_demand_groups", "d2h_chunks", "h2d_chunks",
    "kept_small_bytes", "kept_shared_bytes", "kept_pool_full_bytes", "kept_last_bytes", "served_in_flight_bytes",
    "groups", "exposed_d2h_s", "exposed_h2d_s", "exposed_copy_s",
)
# why a saved storage stayed on the device: under --activation-offload-min-tensor-kb, held by another
# tensor too (releasing ours frees nothing), the host pool full, the last layer before its backward
KEPT_REASONS = ("small", "shared", "pool_full", "last")


class OffloadManager(Hooks):
    """The engine: a host pool, a D2H and an H2D stream, the groups in flight. Its hooks (``hooks.py``)
    tell it when a group is saved, when a layer or pass ends and when backward reaches a group."""

    def __init__(self, options: OffloadOptions, deferred_copies: bool | None = None, *, observer=None):
        """``deferred_copies``: the CPU copy streams run only when waited on (the latest a device
        could); None: as ``options.debug``. ``observer``: ``observer(tensor, module)`` is called for
        every tensor a listed module saves for backward inside a layer (not parameters, strided
        tensors only; ``module``: the listed module's name, e.g. "core_attention", or None), which
        then stays as it is: the manager records nothing and offloads nothing (the planner's trace
        sees through it what offload would see)."""
        self.options = options
        self.observer = observer
        self.debug = options.debug
        self.pool = HostPool(options.pool_bytes, options.chunk_bytes, debug=options.debug)
        deferred = options.debug if deferred_copies is None else deferred_copies
        self.d2h = streams.Stream(deferred=deferred)
        self.h2d = streams.Stream(deferred=deferred)
        self._timed = not streams.cuda()  # on CUDA a compute-stream wait does not block the host
        self._handles = []
        # Storages of parameters (and their main grads), by StorageImpl identity: their bytes are
        # never offloaded. A sharded wrapper (Megatron-FSDP) points a layer's parameters at a bucket
        # whose storage it frees and reallocates around every use, so a layer's own keys are read
        # again when its forward starts (its pre-forward unshard hook ran before ours).
        self._static_keys: set = set()
        self._layer_keys: set = set()  # the current layer's, read when its forward starts
        self._layer_params: dict = {}  # id(layer) -> its parameters
        self._layer_chunk: dict = {}  # id(layer) -> model chunk index (layers with offload targets)
        self._first_layer: dict = {}  # chunk index -> id of its first such layer
        self._pass: Pass | None = None
        # which pass runs backward next, as in the previous epoch: prefetch can cross passes
        self.order = BackwardOrder()
        self._pass_counter: dict = {}
        self._group: Group | None = None
        self._pending: Group | None = None
        self._offloading: list = []  # groups whose D2H was issued since the last tick
        self._last_d2h = None  # the D2H stream's latest event: waiting for it covers every earlier copy
        self._alive: list = []  # reload buffers (h2d event, record, buffer), in issue order, until the compute stream waited
        self._pushed = 0
        self._saving: list = []  # (module name, sub-module path) of each pushed hook, innermost last
        self._faults: set = set()  # tests only: skip_h2d_wait, early_release, early_slot_return, reload_in_flight
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        # {(module name, sub-module path): {"saved": bytes, "offloaded": bytes}}: what each hooked
        # sub-module saved for backward and how much of it left the device (none may be bypassed)
        self.module_stats: dict = {}
        # {module name: {reason: bytes}}: what each listed module's hooks kept on the device, and why
        self.kept_by_module: dict = {}
        self.explained: set = set()  # (module, reason) the log has said (offload.at_log_line), once a run

    # ------------------------------------------------------------------ engine
    def close(self) -> None:
        """Finish the copies in flight and stop the copy streams' CPU workers (they restart if used
        again); the counters stay readable."""
        try:
            self.synchronize()
        finally:
            self.d2h.close()
            self.h2d.close()

    def _count(self, rec, what: str) -> None:
        entry = self.module_stats.setdefault(rec.module, {"saved": 0, "offloaded": 0})
        entry[what] += rec.nbytes

    def _kept(self, module, reason: str, nbytes: int) -> None:
        """``nbytes`` a listed module saved stay on the device, for ``reason`` (KEPT_REASONS)."""
        self.stats[f"kept_{reason}_bytes"] += nbytes
        if module is not None:
            per = self.kept_by_module.setdefault(module[0], dict.fromkeys(KEPT_REASONS, 0))
            per[reason] += nbytes

    def _prefetch(self, groups) -> None:
        for g in groups:
            if g.state in ("offloading", "offloaded"):
                self._reload(list(g.records.values()), g)
                self.stats["prefetched_groups"] += 1

    def _cancel(self, group: Group) -> None:
        """The group's backward comes before its offload was issued: it never leaves the device."""
        self._pending = None
        for rec in group.records.values():
            if rec.state == PACKED:
                rec.state = KEPT
                self._kept(rec.module, "last", rec.nbytes)
        group.state = "kept"
        self._drop(group)

    # ------------------------------------------------------------------ copies
    def _offload(self, group: Group) -> None:
        compute_done = None
        for rec in group.records.values():
            if rec.state != PACKED:
                continue
            if not _solely_ours(rec):  # someone else holds it: releasing ours frees nothing
                rec.state = KEPT
                self._kept(rec.module, "shared", rec.nbytes)
                continue
            slots = self.pool.take(rec.nbytes)
            if slots is None:
                rec.state = KEPT
                self._kept(rec.module, "pool_full", rec.nbytes)
                continue
            if compute_done is None:
                compute_done = streams.Stream.current().record()
                compute_done.wait(self.d2h)
            for fence in self.pool.fences(slots):  # the last copy out of a reused slot is done first
                fence.wait(self.d2h)
            rec.slots, rec.state = slots, COPYING
            self.d2h.run(functools.partial(self._copy_out, rec.storage, rec.device, rec.nbytes, slots), rec.nbytes)
            rec.d2h_event = self._last_d2h = self.d2h.record()
            self.stats["offloaded_bytes"] += rec.nbytes
            self._count(rec, "offloaded")
            self.stats["d2h_chunks"] += len(slots)
        if compute_done is None:
            group.state = "kept"
            self._drop(group)
            return
        group.state = "offloading"
        self._offloading.append(group)
        if "early_release" in self._faults:
            self._release(group)

    def _copy_out(self, storage, device, nbytes, slots) -> None:
        src = _bytes_view(storage, device)
        c = self.pool.chunk_bytes
        for j, sid in enumerate(slots):
            n = min(c, nbytes - j * c)
            self.pool.slots[sid][:n].copy_(src[j * c : j * c + n], non_blocking=True)

    def _copy_in(self, dst: torch.Tensor, nbytes, slots) -> None:
        c = self.pool.chunk_bytes
        for j, sid in enumerate(slots):
            n = min(c, nbytes - j * c)
            dst[j * c : j * c + n].copy_(self.pool.slots[sid][:n], non_blocking=True)

    def _release(self, group: Group) -> None:
        for rec in group.records.values():
            if rec.state == COPYING:
                if self.debug:
                    _bytes_view(rec.storage, rec.device).fill_(POISON)
                    rec.storage.resize_(0)
                rec.storage = None
                rec.state = OFFLOADED
        group.state = "offloaded"

    def _tick(self) -> None:
        """A hook boundary: the compute stream waits for every D2H issued before it (one wait on the
        latest covers all: the D2H stream runs in order), then those groups' device storages are
        dropped. Stream-ordered: on CUDA the host does not block and the caching allocator can reuse
        the bytes at once for later compute-stream work; the CPU model's host blocks for the copy's
        remaining time, which is counted as exposed copy time."""
        if self._offloading:
            t0 = time.perf_counter()
            self._last_d2h.wait(streams.Stream.current())
            self._exposed("exposed_d2h_s", t0)
            for g in self._offloading:
                if g.state == "offloading":
                    self._release(g)
            self._offloading = []
        if self._alive:  # reload buffers whose H2D is done may go (their record decides)
            self._alive = [a for a in self._alive if not a[0].query()]

    def _reloaded(self, rec) -> None:
        """The compute stream now waits for ``rec``'s H2D, and so for every H2D issued before it (the
        H2D stream runs in order): those buffers live as long as their records, no longer. Held
        until the next hook instead, a layer's consumed reloads (the 1 GiB attention probabilities
        of the local spec) stayed allocated through the rest of its backward, at its peak."""
        for i, a in enumerate(self._alive):
            if a[1] is rec:
                del self._alive[: i + 1]
                return

    def _exposed(self, key: str, t0: float) -> None:
        if self._timed:
            dt = time.perf_counter() - t0
            self.stats[key] += dt
            self.stats["exposed_copy_s"] += dt

    def _give(self, slots, stream) -> None:
        """Slots go back to the pool with the event that ends the last copy out of them (queued so
        far on ``stream``); in debug mode they are poisoned in that stream's order."""
        if self.debug:
            stream.run(functools.partial(self.pool.poison, slots))
        self.pool.give(slots, fence=stream.record())

    def _reload(self, records, group: Group | None) -> None:
        current = None
        for rec in records:
            if rec.state == COPYING and "reload_in_flight" not in self._faults:
                # D2H still in flight: the device storage is still ours, use it (never read the slots)
                rec.state = KEPT
                self.stats["served_in_flight_bytes"] += rec.nbytes
                self._give(rec.slots, self.d2h)
                rec.slots = None
            elif rec.state in (OFFLOADED, COPYING):
                if current is None:
                    current = streams.Stream.current()
                dst = torch.empty(rec.nbytes, dtype=torch.uint8, device=rec.device)  # compute-stream memory
                if self.debug:
                    dst.fill_(POISON)
                current.record().wait(self.h2d)
                self.h2d.run(functools.partial(self._copy_in, dst, rec.nbytes, rec.slots), rec.nbytes)
                rec.h2d_event = self.h2d.record()
                rec.reloaded, rec.state = dst.untyped_storage(), RELOADING
                # should the record die before the compute stream waited for its H2D, the buffer stays
                # ours until the copy is done (``_reloaded``); the first wait lets it go at once
                self._alive.append((rec.h2d_event, rec, dst))
                if "early_slot_return" in self._faults:
                    self.pool.give(rec.slots)  # no fence: poisoned (debug) and reusable at once
                else:
                    self._give(rec.slots, self.h2d)
                rec.slots = None
                self.stats["reloaded_bytes"] += rec.nbytes
                self.stats["h2d_chunks"] += self.pool.slots_for(rec.nbytes)
        if group is not None:
            group.state = "consumed"
            self._drop(group)

    def _drop(self, group: Group) -> None:
        """The manager forgets the group: its records now live only as long as autograd's handles."""
        if group in self._offloading:
            self._offloading.remove(group)
        group.records = {}

    # ------------------------------------------------------------------ step level
    def synchronize(self) -> None:
        """Wait (host) for every copy in flight and release what they carried (end of a step / detach)."""
        self.d2h.synchronize()
        self.h2d.synchronize()
        for g in self._offloading:
            if g.state == "offloading":
                self._release(g)
        self._offloading = []
        self._alive = []

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        self.module_stats = {}
        self.kept_by_module = {}

    def offloaded_by_module(self) -> dict:
        """{module name: bytes offloaded}, over every sub-module hooked for it."""
        out = dict.fromkeys(self.options.modules, 0)
        for (name, _path), entry in self.module_stats.items():
            out[name] = out.get(name, 0) + entry["offloaded"]
        return out


_MANAGER: OffloadManager | None = None


def attach(model_chunks, options: OffloadOptions, deferred_copies: bool | None = None) -> OffloadManager:
    global _MANAGER
    from megatron_ext.seams import schedules as seams

    detach()
    _MANAGER = OffloadManager(options, deferred_copies).attach(model_chunks)
    seams.bind_offload_manager(_MANAGER)  # megatron's combined-1F1B plan delimits its groups
    return _MANAGER


def detach() -> None:
    global _MANAGER
    from megatron_ext.seams import schedules as seams

    manager, _MANAGER = _MANAGER, None
    seams.bind_offload_manager(None)
    if manager is not None:
        manager.detach()


def current() -> OffloadManager | None:
    return _MANAGER
