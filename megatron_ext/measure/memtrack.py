"""An independent tracker of device-resident tensor bytes, for tests and the benchmark.

It does not read the offload code's counters. On CPU (where "device" and "host" are one memory) a
``TorchDispatchMode`` sees the outputs of every aten op the process runs, forward and backward, and
keeps a weak reference to each distinct storage it sees; after an op that allocates or grows a
storage it drops the storages that died and sums the live ones (between two such ops the sum can only
fall, so the peak is the same as with a sweep after every op, which a recorded timeline still has).
Storages named in ``exclude`` (parameters, gradient buffers, the host pool) and storages already alive
when tracking starts (found through the garbage collector: the step's input batches, for instance:
``live_tensors``) are not counted, so what is left is the activations and temporaries the step itself
allocates. On CUDA :class:`CudaPeak` measures the same thing with the caching allocator's own counters
(``torch.cuda.max_memory_allocated``, reset per measured step).
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def live_tensors() -> list:
    """Every tensor the garbage collector tracks: the repository's one walk over ``gc.get_objects()``.
    An object's class is read from its type, never through the object: ``isinstance`` asks the object
    for ``__class__``, which a dead ``weakref.proxy`` answers with ``ReferenceError`` (a CUDA process
    holds one) and a lazily imported module with an import or a deprecation warning."""
    import gc

    return [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]


class LiveBytesTracker(TorchDispatchMode):
    def __init__(self, exclude_ptrs=(), device_type: str = "cpu", record_timeline: bool = False):
        super().__init__()
        self.exclude = set(exclude_ptrs)
        self.device_type = device_type
        self.live: dict = {}  # data_ptr -> (StorageWeakRef, nbytes)
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.timeline: list | None = [] if record_timeline else None
        self.baseline: dict = {}

    def __enter__(self):
        self.baseline = {}
        for obj in live_tensors():
            try:
                if obj.device.type == self.device_type and obj.layout == torch.strided:
                    st = obj.untyped_storage()
                    if st.data_ptr():
                        self.baseline[st.data_ptr()] = StorageWeakRef(st)
            except Exception:  # noqa: BLE001 - exotic tensor subclasses: not activations
                continue
        return super().__enter__()

    sweep_every_op = False  # a subclass that records when each storage died sets it

    def _sweep(self) -> None:
        expired = torch.UntypedStorage._expired  # StorageWeakRef.expired, without its two Python calls
        dead = [ptr for ptr, (ref, _n) in self.live.items() if expired(ref.cdata)]
        for ptr in dead:
            self.current -= self.live.pop(ptr)[1]

    def _storage(self, t) -> tuple | None:
        """(``t``'s storage, its address), or None for what is never counted: not a strided tensor of
        this device, no storage, or an excluded one."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type or t.layout != torch.strided:
            return None
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        ptr = storage.data_ptr()
        return None if ptr == 0 or ptr in self.exclude else (storage, ptr)

    def _counts(self, t) -> bool:
        """Whether ``_see(t)`` would count bytes: a storage not alive in ``live`` (new, or at the address
        of one that died since the last sweep) or resized."""
        found = self._storage(t)
        if found is None:
            return False
        storage, ptr = found
        base = self.baseline.get(ptr)
        if base is not None:
            return base.expired()
        known = self.live.get(ptr)
        return known is None or known[1] != storage.nbytes() or known[0].expired()

    def _see(self, t) -> None:
        found = self._storage(t)
        if found is None:
            return
        storage, ptr = found
        base = self.baseline.get(ptr)
        if base is not None:
            if not base.expired():
                return  # alive before the step: not the step's activation
            del self.baseline[ptr]  # its address was freed and reused by a new storage
        known = self.live.get(ptr)
        if known is not None:
            if known[1] != storage.nbytes():  # resized in place
                self.current += storage.nbytes() - known[1]
                self.live[ptr] = (known[0], storage.nbytes())
            return
        self.live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.current += storage.nbytes()

    def _run(self, func, args, kwargs):
        return func(*args, **(kwargs or {}))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._run(func, args, kwargs)
        outputs = tree_flatten(out)[0]
        if self.sweep_every_op or self.timeline is not None or any(self._counts(t) for t in outputs):
            self._sweep()
            for t in outputs:
                self._see(t)
        self.ops += 1
        if self.current > self.peak:
            self.peak = self.current
        if self.timeline is not None:
            self.timeline.append(self.current)
        return out

    def sample(self) -> int:
        """Live bytes now (frees since the last op included)."""
        self._sweep()
        return self.current


class CudaPeak:
    """Peak device bytes allocated during the ``with`` block above what was allocated at its start
    (parameters, gradients, the step's inputs), from the caching allocator; same interface as
    :class:`LiveBytesTracker` (``peak``; no timeline)."""

    def __init__(self, *_, **__):
        self.peak = 0
        self.timeline = None
        self._base = 0

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._base = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self._base
        return False


def model_state_ptrs(model_chunks) -> set:
    """Storages of parameters and their gradients (.grad / .main_grad), which are not activations."""
    ptrs = set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            ptrs.add(p.untyped_storage().data_ptr())
            for g in (p.grad, getattr(p, "main_grad", None)):
                if g is not None:
                    ptrs.add(g.untyped_storage().data_ptr())
    return ptrs
