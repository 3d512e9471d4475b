"""Find host-device synchronisations, and what breaks CUDA-graph capture, without a GPU.

On CUDA an operation synchronises the host with the device when the host needs a value that only
the device has: a scalar read (``.item()``, ``int(t)``, ``if t:``), a device-to-host copy
(``.cpu()``, ``.tolist()``, ``.numpy()``), an op whose *output shape* depends on device data
(``nonzero``, ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without
``output_size``, ``unique``, ``bincount`` ...), or an explicit ``synchronize()``. Two more classes were
seen on a GPU and are invisible on a CPU, where everything is one device:

* **a host tensor entering an op with device tensors** (0-dim included: ``torch.zeros(())`` made
  without ``device=``): a host-to-device copy from pageable memory, a synchronisation, and an error
  inside CUDA-graph capture ("Cannot copy between CPU and CUDA tensors during CUDA graph capture");
* **ops that read device values on the host in some dtypes only** (:data:`DTYPE_SYNCS`):
  ``torch._grouped_mm`` runs torch's fallback, which reads its offsets on the host, unless every
  operand and the output are bf16 on compute capability 9.x/10.x.

On a CPU-only machine every tensor is a CPU tensor, so the detector tracks which tensors *would* be
on the device ("device-resident") and which on the host:

* device-resident: tensors that existed before the detector started (parameters, inputs, buffers),
  unless marked host with :meth:`SyncDetector.mark_host`; every op output with a device input;
  factory calls given a device (``torch.zeros(..., device=x.device)``, ``device=torch.cuda.current_device()``);
* host: results of ``.cpu()`` / ``.to("cpu")`` / ``.numpy()``; factory calls with no device or
  ``device="cpu"`` (on a CUDA machine those are CPU tensors too); op outputs with only host inputs;
  the CPU generator's state (``torch.get_rng_state()``, which megatron's RNG tracker compares on the
  host at every fork, tensor_parallel/random.py:332; :data:`HOST_PRODUCERS`).

A :class:`torch.overrides.TorchFunctionMode` sees Python-level calls (``tolist``, ``item``, ``cpu``,
factories, with their device argument *before* the CPU shims rewrite ``cuda`` to ``cpu``); a
:class:`torch.utils._python_dispatch.TorchDispatchMode` sees every aten op, forward and backward
(autograd runs on the calling thread on CPU), and propagates residency. On a real GPU residency is
simply ``tensor.is_cuda``; the benchmark additionally uses ``torch.cuda.set_sync_debug_mode``.

``emulate_cuda_dtoh=True`` (default) makes megatron-core's ``maybe_move_tensor_to_cpu``
(moe_utils.py:1169, a no-op for CPU tensors) behave as on CUDA: a *non-blocking* copy to the host
(not a sync by itself) and the event ``synchronize()`` that follows it counted as the sync
(token_dispatcher.py:952). Without that, megatron's single batched sync point would be counted as
several reads of device tensors. That replacement is the seam ``moe.emulated_dtoh``
(megatron_ext/seams/moe.py), applied for the detector's lifetime only.
"""
from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from megatron_ext.patching import set_attr, undo_all
from megatron_ext.platform.target import DEFAULT_GPU, GPUS
from megatron_ext.seams import moe as moe_seams

aten = torch.ops.aten


@dataclass
class SyncEvent:
    # what the detector flags, by class: the host reads ("scalar-read", "d2h-copy",
    # "data-dependent-shape", "explicit-sync"), a host tensor in a device op
    # ("host-tensor-in-device-op": a host-to-device copy; fails inside CUDA-graph capture), and an op
    # that syncs in this dtype only ("dtype-dependent-sync")
    kind: str
    op: str
    phase: str
    where: str

    def __str__(self) -> str:
        return f"[{self.phase}] {self.kind}: {self.op} at {self.where}"


_HERE = (os.path.abspath(__file__), os.path.abspath(moe_seams.__file__))  # our frames, not the site
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SHIMS_DIR = os.path.join("platform", "cpu_shims", "")  # the CPU shims' frames (platform/cpu_shims/)


def _site() -> str:
    """Innermost frame outside torch and this file: the code that asked for the sync."""
    frames = traceback.extract_stack()
    for fr in reversed(frames):
        path = os.path.abspath(fr.filename)
        if path in _HERE or path.startswith(_TORCH_DIR) or _SHIMS_DIR in path:
            continue
        marker = "/site-packages/"
        short = path.split(marker, 1)[1] if marker in path else os.path.relpath(path)
        return f"{short}:{fr.lineno} ({fr.name})"
    return "?"


# aten ops whose output size depends on device data, or that return a host value.
_SHAPE_OPS = {
    "nonzero", "argwhere", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "bincount",
}
# the GPU a declared CUDA target is validated for by default (a Hopper)
DEFAULT_CAPABILITY = GPUS[DEFAULT_GPU][0]
# GPUs whose grouped GEMM runs without reading its offsets on the host (torch._grouped_mm's CUTLASS kernel,
# bf16 only; aten/src/ATen/native/cuda/GroupedBlas.cpp): compute capability major 9 (Hopper) and 10 (Blackwell)
GROUPED_GEMM_ARCHS = (9, 10)


def _grouped_mm_sync(args, kwargs, capability) -> Optional[str]:
    """aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``: the CUTLASS kernel runs when
    both operands and the output are bf16 on compute capability 9.x or 10.x; otherwise
    ``_grouped_mm_fallback`` copies the offsets to the host (``offs.cpu()``) and loops over the groups."""
    a, b = args[0], args[1]
    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None)
    bf16 = a.dtype == b.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16)
    if bf16 and capability[0] in GROUPED_GEMM_ARCHS:
        return None
    why = f"{a.dtype}" if not bf16 else f"compute capability {capability[0]}.{capability[1]}"
    return f"torch's grouped-GEMM fallback reads the offsets on the host ({why})"


# aten op -> (args, kwargs, compute capability) -> why it syncs there, or None: ops that read device
# values on the host in some dtypes / on some GPUs only (seen on an H200: 2 syncs forward, 4 backward
# per zero-sync layer in fp32).
DTYPE_SYNCS = {"_grouped_mm": _grouped_mm_sync}
_SCALAR_OPS = {"_local_scalar_dense", "item", "equal", "is_nonzero", "allclose"}
_FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.empty_strided, torch.scalar_tensor,
}
_HOST_READS = {
    torch.Tensor.tolist: "tolist", torch.Tensor.item: "item", torch.Tensor.numpy: "numpy",
    torch.Tensor.__bool__: "__bool__", torch.Tensor.__int__: "__int__",
    torch.Tensor.__float__: "__float__", torch.Tensor.__index__: "__index__",
    torch.Tensor.__repr__: "__repr__", torch.Tensor.__format__: "__format__",
}


def _is_host_device(device) -> bool:
    return device is None or (isinstance(device, str) and device.startswith("cpu"))


def _requested_device(args, kwargs):
    """For Tensor.to / Tensor.cpu / Tensor.cuda: the target device, or None when unchanged."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
    return None


def _dev_type(device) -> str:
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):  # parsed here: torch.device("cuda") is rewritten under the CPU shims
        return device.split(":")[0]
    return "cuda"  # an int ordinal


# Functions outside torch's dispatch that return host tensors on a CUDA machine too: wrapped for the
# detector's lifetime, their results marked host.
HOST_PRODUCERS = ((torch, "get_rng_state"), (torch.random, "get_rng_state"))


class _FunctionSide(TorchFunctionMode):
    def __init__(self, det: "SyncDetector"):
        super().__init__()
        self.det = det

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        det = self.det
        if func in (torch.autograd.backward, torch.Tensor.backward):
            # A mode is suspended inside its own handler, and re-entering it around `func` would
            # recurse; run the engine directly with the mode active, so code in custom
            # autograd.Function backwards is seen.
            with self:
                return run_backward(*args, **kwargs)
        if func in _HOST_READS and args and det.is_device(args[0]):
            det._record("scalar-read" if func is not torch.Tensor.tolist else "d2h-copy", _HOST_READS[func])
            with det._suppressed():
                return func(*args, **kwargs)
        if func is torch.Tensor.cpu or func is torch.Tensor.to:
            target = "cpu" if func is torch.Tensor.cpu else _requested_device(args, kwargs)
            # A torch.device("cpu") object is ambiguous here (x.to(y.device) with y on the device
            # reads the same on a CPU machine): only an explicit "cpu" string or .cpu() is a D2H.
            if isinstance(target, torch.device) and target.type == "cpu":
                target = None
            if target is not None:
                src = args[0]
                src_dev = det.is_device(src)
                with det._suppressed():
                    out = func(*args, **kwargs)
                if out is src:  # on CPU both are the same tensor; a transfer makes a new one
                    out = out.clone()
                if _dev_type(target) == "cpu":
                    if src_dev:
                        if kwargs.get("non_blocking", False):
                            det.pending_copies += 1
                        else:
                            det._record("d2h-copy", "to(cpu)")
                    det._set(out, False)
                else:
                    if not src_dev and not det._suppress:
                        det._record("host-tensor-in-device-op", f"to({target}) of a host "
                                    f"{tuple(src.shape)} {str(src.dtype).replace('torch.', '')}")
                    det._set(out, True)
                return out
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not (args and out is args[0]):  # as_tensor(t) is t
                det._set(out, not _is_host_device(kwargs.get("device")))
            return out
        if func is torch.from_numpy:
            out = func(*args, **kwargs)
            det._set(out, False)
            return out
        return func(*args, **kwargs)


class _DispatchSide(TorchDispatchMode):
    def __init__(self, det: "SyncDetector"):
        super().__init__()
        self.det = det

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        det = self.det
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [det.is_device(t) for t in inputs]
        any_dev = any(on_device)
        name = func.overloadpacket.__name__
        if any_dev and not det._suppress:
            reason = self._sync_reason(func, name, args, kwargs)
            if reason is not None:
                det._record(reason, f"aten.{func.__name__}")
            host = [t for t, d in zip(inputs, on_device) if not d]
            if host:
                det._record("host-tensor-in-device-op", f"aten.{func.__name__} with a host "
                            + ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in host))
            dtype_rule = DTYPE_SYNCS.get(name)
            why = dtype_rule(args, kwargs, det.capability) if dtype_rule is not None else None
            if why is not None:
                det._record("dtype-dependent-sync", f"aten.{func.__name__}: {why}")
        out = func(*args, **kwargs)
        if inputs and not det.real_cuda:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    det._set(t, any_dev)
            if any_dev:
                for i, arg in enumerate(func._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        target = args[i] if i < len(args) else kwargs.get(arg.name)
                        if isinstance(target, torch.Tensor):
                            det._set(target, True)
        return out

    def _sync_reason(self, func, name, args, kwargs) -> Optional[str]:
        det = self.det
        if name in _SCALAR_OPS:
            return "scalar-read"
        if name in _SHAPE_OPS:
            return "data-dependent-shape"
        if name == "histc" and len(args) > 3 and args[2] == args[3]:
            return "data-dependent-shape"  # min == max: range read from the data
        if name == "repeat_interleave" and func.__name__.endswith("Tensor"):
            if kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None):
                return "data-dependent-shape"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for ix in indices or ():
                if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8) and det.is_device(ix):
                    return "data-dependent-shape"
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if det.is_device(src) and not det.is_device(dst):
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                if non_blocking:
                    det.pending_copies += 1
                    return None
                return "d2h-copy"
        return None


class SyncDetector:
    """Context manager recording every host-device sync a block of code would cause on CUDA.

    >>> with SyncDetector() as det:
    ...     with det.phase("forward"):
    ...         y = layer(x)
    >>> det.count("forward"), [str(e) for e in det.events]
    """

    def __init__(self, emulate_cuda_dtoh: bool = True, raise_on_sync: bool = False, capability=None):
        self.real_cuda = torch.cuda.is_available() and torch.version.cuda is not None and _real_cuda_runtime()
        # the GPU whose dtype-dependent syncs (DTYPE_SYNCS) are flagged: this one, or a Hopper
        self.capability = tuple(capability or (torch.cuda.get_device_capability() if self.real_cuda
                                               else DEFAULT_CAPABILITY))
        self.emulate_cuda_dtoh = emulate_cuda_dtoh and not self.real_cuda
        self.raise_on_sync = raise_on_sync
        self.events: List[SyncEvent] = []
        self.pending_copies = 0
        self._residency = WeakTensorKeyDictionary()  # tensor -> True (device) / False (host)
        self._phase = "all"
        self._suppress = 0
        self._stack = contextlib.ExitStack()

    # ---------------------------------------------------------------- residency
    def is_device(self, t: torch.Tensor) -> bool:
        if self.real_cuda:
            return t.is_cuda
        return self._residency.get(t, True)

    def _set(self, t: torch.Tensor, device: bool) -> None:
        if not self.real_cuda:
            self._residency[t] = device

    def _host_result(self, fn):
        def produce(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.mark_host(out)
            return out

        return produce

    def mark_host(self, *tensors) -> None:
        """Tensors that are CPU tensors on a CUDA machine too (e.g. index tables kept on the host)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._set(t, False)

    # ---------------------------------------------------------------- recording
    def _record(self, kind: str, op: str) -> None:
        event = SyncEvent(kind, op, self._phase, _site())
        self.events.append(event)
        if self.raise_on_sync:
            raise RuntimeError(f"host-device sync: {event}")

    @contextlib.contextmanager
    def _suppressed(self):
        self._suppress += 1
        try:
            yield
        finally:
            self._suppress -= 1

    @contextlib.contextmanager
    def phase(self, name: str):
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    def count(self, phase: Optional[str] = None) -> int:
        return sum(1 for e in self.events if phase is None or e.phase == phase)

    def sites(self, phase: Optional[str] = None) -> List[str]:
        return [f"{e.kind}: {e.op} at {e.where}" for e in self.events if phase is None or e.phase == phase]

    # ---------------------------------------------------------------- enter / exit
    def __enter__(self) -> "SyncDetector":
        if self.emulate_cuda_dtoh:
            self._stack.enter_context(moe_seams.emulated_dtoh(self))
        if not self.real_cuda:
            self._stack.callback(undo_all([set_attr(owner, name, self._host_result(getattr(owner, name)))
                                           for owner, name in HOST_PRODUCERS]))
        self._stack.enter_context(_FunctionSide(self))
        self._stack.enter_context(_DispatchSide(self))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False


def run_backward(tensors, gradient=None, retain_graph=None, create_graph=False, inputs=None, **kw):
    """torch.autograd.backward without its __torch_function__ hook (torch/autograd/__init__.py).

    Also the way to run backward on CPU outside the detector: the platform's CPU redirect mode
    re-enters itself around Tensor.backward / torch.autograd.backward and recurses without end
    (megatron's own schedules call the engine directly, like this)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    grad_tensors = kw.pop("grad_tensors", gradient)
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    grad_tensors_ = _tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
    grad_tensors_ = _make_grads(tensors, grad_tensors_, is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else (tuple(inputs) if inputs is not None else ())
    _engine_run_backward(tensors, grad_tensors_, retain_graph, create_graph, inputs,
                         allow_unreachable=True, accumulate_grad=True)


def _real_cuda_runtime() -> bool:
    try:
        return torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001
        return False
