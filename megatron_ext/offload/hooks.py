"""The offload manager's hooks: where it learns what the model does. Module hooks on each model
chunk (a pass begins / ends), on each layer with offload targets (a group begins / ends), and around
each targeted sub-module (the saved-tensor hooks are pushed for its forward); a tensor hook on each
layer's output (the group's backward begins). The hooks are the engine's clock (``manager.py``): each
one ticks it, hands it a group to copy out or to bring back, and feeds the backward-order predictor
(``predictor.py``) that decides when prefetch crosses into another pass.

``Hooks`` is a part of ``manager.OffloadManager``: it reads the manager's state and calls its engine
(``_tick``, ``_offload``, ``_reload``, ``_prefetch``, ``_cancel``, ``_drop``, ``_count``, ``_kept``, ``close``).
"""
from __future__ import annotations

import functools
import time

import torch

from megatron_ext.offload.records import OFFLOADED, PACKED, RELOADING, Group, Pass, Record
from megatron_ext.platform import streams


class _Saved:
    """What autograd holds instead of the tensor: the record and the view to rebuild."""

    __slots__ = ("record", "dtype", "size", "stride", "offset")

    def __init__(self, record, t):
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()



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


class Hooks:
    """The module, saved-tensor and backward hooks of ``manager.OffloadManager`` (its engine and
    state live there)."""

    # ------------------------------------------------------------------ attach
    def attach(self, model_chunks) -> "Hooks":
        from megatron_ext.offload import targets as where  # imports megatron-core: at attach, not at import
        from megatron_ext.seams import unwrapped

        chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
        modules = self.options.modules
        for chunk_idx, chunk in enumerate(chunks):
            for p in chunk.parameters():
                self._static_keys.add(_storage_key(p))
                if getattr(p, "main_grad", None) is not None:
                    self._static_keys.add(_storage_key(p.main_grad))
            root = unwrapped(chunk)
            self._handles.append(root.register_forward_pre_hook(functools.partial(self._begin_pass, chunk_idx)))
            self._handles.append(root.register_forward_hook(self._end_pass))
            for layer in where.offload_layers(root):
                targets = where.offload_targets(layer, modules)
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

    # ------------------------------------------------------------------ forward hooks
    def _active(self) -> bool:
        return torch.is_grad_enabled() and not _in_backward()

    def _begin_pass(self, chunk_idx, _module, _args):
        if self._active():
            index = self._pass_counter.get(chunk_idx, 0)
            self._pass_counter[chunk_idx] = index + 1
            self._pass = Pass(chunk_idx, index)

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
        group = Group((chunk_idx, self._pass.index, getattr(layer, "layer_number", None)), self._pass)
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
        self.order.forwarded(group.pass_)  # the pass now waits for backward
        group.state = "pending"
        self._pending = group
        hidden.register_hook(functools.partial(self._on_backward, group))

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor):
        group = self._group
        if group is None or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        if self.observer is not None:  # seen, not offloaded
            self.observer(t, self._saving[-1][0] if self._saving else None)
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
            module = self._saving[-1] if self._saving else None
            if storage.nbytes() < self.options.min_tensor_bytes:
                self._kept(module, "small", storage.nbytes())
                return t
            rec = group.records[ptr] = Record(storage, t.device, group, module)
            self._count(rec, "saved")
        elif self._saving and self._saving[-1] != rec.module:
            # a storage another hooked module saved first (torch attention's output is linear_proj's
            # input): this module's hooks saw it too; its bytes count once, under the first
            self.module_stats.setdefault(self._saving[-1], {"saved": 0, "offloaded": 0})
        return _Saved(rec, t)

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
                    self._reloaded(rec)
                rec.waited = True
            storage = rec.reloaded
        else:
            storage = rec.storage
        return torch.empty(0, dtype=saved.dtype, device=rec.device).set_(
            storage, saved.offset, saved.size, saved.stride
        )

    # ------------------------------------------------------------------ backward hook
    def _on_backward(self, group: Group, _grad):
        pass_ = group.pass_
        self.order.backward_started(pass_)
        groups = pass_.groups
        before = []
        if group in groups:
            i = groups.index(group)
            before = groups[:i]
            del groups[i]
        if not groups:
            self.order.backward_done(pass_)
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
            nxt = self.order.predict_next_pass(pass_)
            if nxt is not None:
                window += list(reversed(nxt.groups))[: self.options.prefetch_depth - len(window)]
        self._prefetch(window)
        return None

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
        if pending is not None and pending.pass_ is self._pass and self.order.other_comes_next(pending.pass_):
            self._pending = None
            self._offload(pending)
        if self.order.last_was_forward() and self._next_is_backward():
            nxt = self.order.predict_next_pass(None)
            if nxt is not None:
                self._prefetch(list(reversed(nxt.groups))[: self.options.prefetch_depth])

    def _next_is_backward(self) -> bool:
        if self.options.cross_pass_prefetch in ("off", None, False):
            return False
        return self.order.next_is_backward()
