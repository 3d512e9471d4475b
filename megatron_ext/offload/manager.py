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
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
import weakref

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.offload.pool import POISON, HostPool
from megatron_ext.platform import streams

MODULES = ("core_attention", "qkv_linear", "router_fc1", "router_fc2", "shared_experts", "attn_proj", "moe_act")
ALIASES = {"core_attn": "core_attention", "expert_fc1": "router_fc1"}


def canonical_modules(names) -> tuple:
    out = []
    for n in names:
        n = ALIASES.get(n, n)
        if n not in MODULES:
            raise ValueError(n)
        if n not in out:
            out.append(n)
    return tuple(out)


@dataclasses.dataclass
class Options:
    modules: tuple
    pool_bytes: int = 1 << 30
    chunk_bytes: int = 4 << 20
    prefetch_depth: int = 1
    min_tensor_bytes: int = 64 << 10
    debug: bool = False
    # prefetch into the pass predicted to run backward next: "off"; "after-forward" (when a chunk's
    # forward returns and backward comes next); "always" (also at the end of a pass's backward)
    cross_pass_prefetch: str = "after-forward"
    # CPU copy streams deferred (run only when waited on: the latest a device could); None: as debug
    deferred_copies: bool | None = None


# record states
PACKED, KEPT, COPYING, OFFLOADED, RELOADING = "packed", "kept", "copying", "offloaded", "reloading"


class _Record:
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


class _Saved:
    """What autograd holds instead of the tensor: the record and the view to rebuild."""

    __slots__ = ("record", "dtype", "size", "stride", "offset")

    def __init__(self, record, t):
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()


class _Pass:
    __slots__ = ("chunk", "index", "groups", "listed", "started")

    def __init__(self, chunk, index):
        self.chunk, self.index, self.groups = chunk, index, []
        self.listed = self.started = False


class _Group:
    __slots__ = ("key", "records", "state", "pass_", "__weakref__")

    def __init__(self, key, pass_):
        self.key, self.records, self.state, self.pass_ = key, {}, "forward", pass_

    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.records.values()) if self.records else 0


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


class _WrappedCall:
    """An instance method wrapped in push/pop of the saved-tensor hooks; remove() restores it."""

    def __init__(self, obj, name, push, pop):
        self.obj, self.name = obj, name
        original = getattr(obj, name)

        @functools.wraps(original)
        def call(*args, **kwargs):
            push()
            try:
                return original(*args, **kwargs)
            finally:
                pop()

        setattr(obj, name, call)

    def remove(self) -> None:
        if self.name in vars(self.obj):
            delattr(self.obj, self.name)


def _storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's StorageImpl: unchanged when the storage is resized (freed and
    reallocated in place), unlike its data pointer."""
    if isinstance(t, torch.distributed.tensor.DTensor):
        t = t.to_local()
    return t.untyped_storage()._cdata


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


STAT_KEYS = (
    "offloaded_bytes", "reloaded_bytes", "prefetched_groups", "on_demand_groups", "d2h_chunks", "h2d_chunks",
    "kept_small_bytes", "kept_shared_bytes", "kept_pool_full_bytes", "kept_last_bytes", "served_in_flight_bytes",
    "groups", "exposed_d2h_s", "exposed_h2d_s", "exposed_copy_s",
)


class OffloadManager:
    def __init__(self, options: Options):
        self.options = options
        self.debug = options.debug
        self.pool = HostPool(options.pool_bytes, options.chunk_bytes, debug=options.debug)
        deferred = options.debug if options.deferred_copies is None else options.deferred_copies
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
        self._pass: _Pass | None = None
        # backward order, observed: passes waiting for backward (forward order); for each pass that
        # started backward in this "epoch" (until none waits), its index among those not started yet.
        # The previous epoch's log predicts the next pass to run backward, so prefetch can cross passes.
        # The event sequence ("F" a pass forwarded, "B" a pass started backward) tells whether the
        # next thing after a forward pass or a finished backward pass is a backward (only then is a
        # cross-pass prefetch issued, so a prefetched layer never waits through a whole forward).
        self._outstanding: list = []
        self._epoch_log: list = []
        self._prev_log: list = []
        self._events: list = []
        self._prev_events: list = []
        self._pass_counter: dict = {}
        self._group: _Group | None = None
        self._pending: _Group | None = None
        self._offloading: list = []  # groups whose D2H was issued since the last tick
        self._last_d2h = None  # the D2H stream's latest event: waiting for it covers every earlier copy
        self._alive: list = []  # CUDA reload buffers (h2d event, record, buffer) until the compute stream waited
        self._pushed = 0
        self._saving: list = []  # (module name, sub-module path) of each pushed hook, innermost last
        self._faults: set = set()  # tests only: skip_h2d_wait, early_release, early_slot_return, reload_in_flight
        self.stats = dict.fromkeys(STAT_KEYS, 0)
        # {(module name, sub-module path): {"saved": bytes, "offloaded": bytes}}: what each hooked
        # sub-module saved for backward and how much of it left the device (none may be bypassed)
        self.module_stats: dict = {}

    # ------------------------------------------------------------------ attach
    def attach(self, model_chunks) -> "OffloadManager":
        from megatron_ext import seams

        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        modules = self.options.modules
        for chunk_idx, chunk in enumerate(chunks):
            for p in chunk.parameters():
                self._static_keys.add(_storage_key(p))
                if getattr(p, "main_grad", None) is not None:
                    self._static_keys.add(_storage_key(p.main_grad))
            root = seams.offload_unwrap(chunk)
            self._handles.append(root.register_forward_pre_hook(functools.partial(self._begin_pass, chunk_idx)))
            self._handles.append(root.register_forward_hook(self._end_pass))
            for layer in seams.offload_layers(root):
                fused = [m for m in modules if m in ("router_fc1", "router_fc2", "moe_act")]
                if fused and seams.offload_fused_experts(layer):
                    raise ConfigError(
                        f"--use-transformer-engine-op-fuser=True: the experts run as one fused op that never "
                        f"calls their linear_fc1/linear_fc2; --activation-offload-modules {' '.join(fused)} "
                        "would offload nothing"
                    )
                targets = seams.offload_targets(layer, modules)
                if not targets:
                    continue
                self._layer_params[id(layer)] = list(layer.parameters())
                self._layer_chunk[id(layer)] = chunk_idx
                self._first_layer.setdefault(chunk_idx, id(layer))
                path = {id(m): n for n, m in layer.named_modules()}
                for _, _, mods in targets:  # modules run in place of registered ones (grouped experts)
                    for m in mods:
                        for one in (m if isinstance(m, tuple) else (m,)):
                            if id(one) not in path and hasattr(one, "path_in"):
                                path[id(one)] = one.path_in(path)
                self._handles.append(layer.register_forward_pre_hook(functools.partial(self._begin_group, chunk_idx)))
                self._handles.append(layer.register_forward_hook(self._end_group, always_call=True))
                for name, kind, mods in targets:
                    if kind == "module":
                        for m in mods:
                            push = functools.partial(self._push, (name, path[id(m)]))
                            self._handles.append(m.register_forward_pre_hook(push))
                            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
                    elif kind == "calls":  # methods called instead of the module's forward
                        for obj, method in mods:
                            self._handles.append(_WrappedCall(obj, method, functools.partial(
                                self._push, (name, f"{path[id(obj)]}.{method}")), self._pop))
                    else:  # "window": from fc1's exit to fc2's entry (the expert activation)
                        for fc1, fc2 in mods:
                            push = functools.partial(self._push, (name, path[id(fc1)] + ".."))
                            self._handles.append(fc1.register_forward_hook(push, always_call=True))
                            self._handles.append(fc2.register_forward_pre_hook(self._pop, prepend=True))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.close()

    def close(self) -> None:
        """Finish the copies in flight and stop the copy streams' CPU workers (they restart if used
        again); the counters stay readable."""
        try:
            self.synchronize()
        finally:
            self.d2h.close()
            self.h2d.close()

    # ------------------------------------------------------------------ forward hooks
    def _active(self) -> bool:
        return torch.is_grad_enabled() and not _in_backward()

    def _begin_pass(self, chunk_idx, _module, _args):
        if self._active():
            index = self._pass_counter.get(chunk_idx, 0)
            self._pass_counter[chunk_idx] = index + 1
            self._pass = _Pass(chunk_idx, index)

    def _begin_group(self, chunk_idx, layer, _args):
        if not self._active():
            self._group = None
            return
        self._tick()
        if self._pending is not None:
            self._offload(self._pending)
            self._pending = None
        if self._pass is None or self._pass.chunk != chunk_idx:
            self._begin_pass(chunk_idx, None, None)
        self._layer_keys = {_storage_key(p) for p in self._layer_params.get(id(layer), ())}
        group = _Group((chunk_idx, self._pass.index, getattr(layer, "layer_number", None)), self._pass)
        self._pass.groups.append(group)
        self._group = group

    # megatron's combined-1F1B plan (--overlap-moe-expert-parallel-comm) runs a layer as separate
    # nodes, never calling the layer itself: its first node begins the group, its last ends it
    # (megatron_ext/seams/schedules.py, COMBINED_PLAN_OFFLOAD_GROUPS). The layer's sub-modules'
    # own hooks (linear_fc1, ...) fire as usual inside the nodes.
    def plans_layer(self, layer) -> bool:
        return id(layer) in self._layer_chunk

    def plan_layer_begin(self, layer) -> None:
        chunk = self._layer_chunk[id(layer)]
        if self._active() and self._first_layer.get(chunk) == id(layer):
            self._begin_pass(chunk, None, None)  # the model's forward hook never fires in the plan
        self._begin_group(chunk, layer, None)

    def plan_layer_end(self, layer, output) -> None:
        self._end_group(layer, None, output)

    def _push(self, module, *_):
        if self._group is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
            self._pushed += 1
            self._saving.append(module)

    def _pop(self, *_):
        if self._pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self._pushed -= 1
            self._saving.pop()

    def _end_group(self, _layer, _args, output):
        group, self._group = self._group, None
        while self._pushed:  # a window left open (e.g. an exception) closes with its layer
            self._pop()
        if group is None:
            return
        self._tick()  # the previous layer's copy had this layer's forward to finish
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if not group.records or not (isinstance(hidden, torch.Tensor) and hidden.requires_grad):
            group.state = "kept"
            self._drop(group)
            if group in group.pass_.groups:
                group.pass_.groups.remove(group)
            return
        self.stats["groups"] += 1
        pass_ = group.pass_
        if not pass_.listed:  # the pass now waits for backward
            pass_.listed = True
            self._outstanding.append(pass_)
            self._events.append("F")
        group.state = "pending"
        self._pending = group
        hidden.register_hook(functools.partial(self._on_backward, group))

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor):
        group = self._group
        if group is None or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        if storage.nbytes() == 0 or storage._cdata in self._static_keys or storage._cdata in self._layer_keys:
            return t
        ptr = storage.data_ptr()
        rec = group.records.get(ptr)
        if rec is None:
            if storage.nbytes() < self.options.min_tensor_bytes:
                self.stats["kept_small_bytes"] += storage.nbytes()
                return t
            module = self._saving[-1] if self._saving else None
            rec = group.records[ptr] = _Record(storage, t.device, group, module)
            self._count(rec, "saved")
        return _Saved(rec, t)

    def _count(self, rec, what: str) -> None:
        entry = self.module_stats.setdefault(rec.module, {"saved": 0, "offloaded": 0})
        entry[what] += rec.nbytes

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        rec = saved.record
        if rec.state == PACKED:  # backward reached the group before its hook: keep it on the device
            group = rec.group()
            if group is not None and group is self._pending:
                self._cancel(group)
        elif rec.state == OFFLOADED:  # nothing prefetched it: reload now
            group = rec.group()
            self._reload(list(group.records.values()) if group is not None and group.records else [rec], group)
            self.stats["on_demand_groups"] += 1
        if rec.state == RELOADING:
            if not rec.waited:
                if "skip_h2d_wait" not in self._faults:
                    t0 = time.perf_counter()
                    rec.h2d_event.wait(streams.Stream.current())
                    self._exposed("exposed_h2d_s", t0)
                rec.waited = True
            storage = rec.reloaded
        else:
            storage = rec.storage
        return torch.empty(0, dtype=saved.dtype, device=rec.device).set_(
            storage, saved.offset, saved.size, saved.stride
        )

    # ------------------------------------------------------------------ backward hook
    def _on_backward(self, group: _Group, _grad):
        pass_ = group.pass_
        if not pass_.started and pass_ in self._outstanding:
            waiting = [p for p in self._outstanding if not p.started]
            self._epoch_log.append(waiting.index(pass_))
            self._events.append("B")
            pass_.started = True
        groups = pass_.groups
        before = []
        if group in groups:
            i = groups.index(group)
            before = groups[:i]
            del groups[i]
        if not groups and pass_ in self._outstanding:
            self._outstanding.remove(pass_)
            if not self._outstanding:  # every forwarded pass is back-propagated: an epoch ends
                self._prev_log, self._epoch_log = self._epoch_log, []
                self._prev_events, self._events = self._events, []
        self._tick()
        if group is self._pending:
            self._cancel(group)
        else:
            if self._pending is not None:
                self._offload(self._pending)
                self._pending = None
            if group.state in ("offloading", "offloaded"):
                self._reload(list(group.records.values()), group)
                self.stats["on_demand_groups"] += 1
        # prefetch window: the next `depth` groups backward will reach: this pass's earlier layers,
        # then (if fewer remain) the last layers of the pass predicted to run backward next
        window = list(reversed(before))[: self.options.prefetch_depth]
        if (len(window) < self.options.prefetch_depth and self.options.cross_pass_prefetch == "always"
                and self._next_is_backward()):
            nxt = self._predict_next_pass(pass_)
            if nxt is not None:
                window += list(reversed(nxt.groups))[: self.options.prefetch_depth - len(window)]
        self._prefetch(window)
        return None

    def _prefetch(self, groups) -> None:
        for g in groups:
            if g.state in ("offloading", "offloaded"):
                self._reload(list(g.records.values()), g)
                self.stats["prefetched_groups"] += 1

    def _end_pass(self, _module, _args, _output):
        """A chunk's forward returned. Its last group's copy starts now unless this pass's own
        backward is predicted to come first (so it is released by the next tick instead of staying
        on the device through the first layer of another pass's backward). If backward comes next
        (as in the last epoch), prefetch the last layers of the pass predicted to run backward next,
        overlapping the pipeline's send/recv wait instead of holding them through another forward."""
        if not self._active():
            return
        self._tick()  # before the loss and its gradient: the last copies of this pass are released
        pending = self._pending
        if pending is not None and pending.pass_ is self._pass and self._other_comes_next(pending.pass_):
            self._pending = None
            self._offload(pending)
        if self._events and self._events[-1] == "F" and self._next_is_backward():
            nxt = self._predict_next_pass(None)
            if nxt is not None:
                self._prefetch(list(reversed(nxt.groups))[: self.options.prefetch_depth])

    def _other_comes_next(self, pass_) -> bool:
        """As in the last epoch, what follows this forward is a forward or another pass's backward
        (no prediction in the first epoch: False)."""
        n = len(self._events)
        if n >= len(self._prev_events) or self._prev_events[:n] != self._events:
            return False
        if self._prev_events[n] == "F":
            return True
        nxt = self._predict_next_pass(None)
        return nxt is not None and nxt is not pass_

    def _next_is_backward(self) -> bool:
        if self.options.cross_pass_prefetch in ("off", None, False):
            return False
        n = len(self._events)
        return n < len(self._prev_events) and self._prev_events[:n] == self._events and self._prev_events[n] == "B"

    def _predict_next_pass(self, current):
        k = len(self._epoch_log)
        if k >= len(self._prev_log):
            return None
        waiting = [p for p in self._outstanding if not p.started and p is not current]
        j = self._prev_log[k]
        return waiting[j] if j < len(waiting) else None

    def _cancel(self, group: _Group) -> None:
        """The group's backward comes before its offload was issued: it never leaves the device."""
        self._pending = None
        for rec in group.records.values():
            if rec.state == PACKED:
                rec.state = KEPT
                self.stats["kept_last_bytes"] += rec.nbytes
        group.state = "kept"
        self._drop(group)

    # ------------------------------------------------------------------ copies
    def _offload(self, group: _Group) -> None:
        compute_done = None
        for rec in group.records.values():
            if rec.state != PACKED:
                continue
            if not _solely_ours(rec):  # someone else holds it: releasing ours frees nothing
                rec.state = KEPT
                self.stats["kept_shared_bytes"] += rec.nbytes
                continue
            slots = self.pool.take(rec.nbytes)
            if slots is None:
                rec.state = KEPT
                self.stats["kept_pool_full_bytes"] += rec.nbytes
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

    def _release(self, group: _Group) -> None:
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
        if self._alive:
            self._alive = [a for a in self._alive if not a[1].waited and not a[0].query()]

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

    def _reload(self, records, group: _Group | None) -> None:
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
                if streams.cuda():  # should the record die unconsumed, the block stays ours until the H2D is done
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

    def _drop(self, group: _Group) -> None:
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

    def offloaded_by_module(self) -> dict:
        """{module name: bytes offloaded}, over every sub-module hooked for it."""
        out = dict.fromkeys(self.options.modules, 0)
        for (name, _path), entry in self.module_stats.items():
            out[name] = out.get(name, 0) + entry["offloaded"]
        return out


_MANAGER: OffloadManager | None = None


def attach(model_chunks, options: Options) -> OffloadManager:
    global _MANAGER
    detach()
    _MANAGER = OffloadManager(options).attach(model_chunks)
    return _MANAGER


def detach() -> None:
    global _MANAGER
    manager, _MANAGER = _MANAGER, None
    if manager is not None:
        manager.detach()


def current() -> OffloadManager | None:
    return _MANAGER
