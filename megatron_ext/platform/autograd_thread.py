"""CUDA-faithful CPU mode, part (a): every backward runs on the autograd engine's device thread.

On a GPU, PyTorch's autograd engine runs the nodes of a CUDA graph on its per-device worker thread
while the thread that called ``backward()`` waits; a backward started from that worker thread
(reentrant: megatron's recompute, checkpoint's inner ``torch.autograd.backward``) runs inline on it.
The engine carries torch's thread-local state to the worker (grad mode, torch-function and dispatch
mode stacks, the saved-tensor default hooks, the stashed context); Python ``threading.local`` values
are not carried. So custom ``autograd.Function.backward`` code, hooks and every collective a
backward issues run on a thread other than the caller's.

Without CUDA, torch runs CPU backward on the calling thread. In the faithful mode this stands in
for ``Variable._execution_engine`` and sends every ``run_backward`` to one worker thread per
process, with that state, while the caller blocks. Outside the mode it is a pass-through.

Upstream entry points it covers (all reach ``Variable._execution_engine.run_backward``):
megatron/core/pipeline_parallel/schedules.py:220 (custom_backward), :574 and :647
(torch.autograd.backward in backward_step), megatron/core/tensor_parallel/random.py:656 and :718
(recompute inside backward, reentrant).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import torch

from megatron_ext.platform import faithful


def _capture_state() -> dict:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return {
        "grad": torch.is_grad_enabled(),
        "function_modes": list(_get_current_function_mode_stack()),
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "saved_tensor_hooks": hooks,
        "context": torch._C._get_obj_in_tls("context") if torch._C._is_key_in_tls("context") else None,
    }


def _run_with_state(state: dict, fn: Callable, args, kwargs):
    for mode in state["function_modes"]:
        torch._C._push_on_torch_function_stack(mode)
    for mode in state["dispatch_modes"]:
        torch._C._push_on_torch_dispatch_stack(mode)
    hooks = state["saved_tensor_hooks"]
    if hooks is not None:
        torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
    if state["context"] is not None:
        torch._C._stash_obj_in_tls("context", state["context"])
    try:
        with torch.set_grad_enabled(state["grad"]):
            return fn(*args, **kwargs)
    finally:
        if state["context"] is not None:
            torch._C._remove_obj_from_tls("context")
        if hooks is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        for _ in state["dispatch_modes"]:
            torch._C._pop_torch_dispatch_stack(None)
        for _ in state["function_modes"]:
            torch._C._pop_torch_function_stack()


IDLE_S = 0.05  # the worker exits after this long without work (started again on demand: ~0.1 ms)
CALLS = 0  # backward calls sent to the device thread (tests)


class DeviceThread:
    """One worker thread that runs the backward calls given to it, one at a time. It exits once idle
    for IDLE_S, so a process holds no extra thread between steps; one is started again on demand."""

    def __init__(self):
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.stopped = False
        self.thread = threading.Thread(target=self._main, name="autograd-device-thread", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with _LOCK:
                    if self.jobs.empty():
                        self.stopped = True
                        return
                continue
            state, fn, args, kwargs, box, done = job
            try:
                box["result"] = _run_with_state(state, fn, args, kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                box["error"] = e
            finally:
                done.set()
                # hold nothing of this backward while idle (its graph, modules, process groups)
                job = state = fn = args = kwargs = box = done = None


_WORKER: Optional[DeviceThread] = None
_LOCK = threading.Lock()


def run_on_device_thread(fn: Callable, args, kwargs):
    """fn(*args, **kwargs) on the device thread with the caller's torch thread-local state; the
    caller blocks until it returns (its exception is raised here)."""
    global _WORKER, CALLS
    box: dict = {}
    done = threading.Event()
    job = (_capture_state(), fn, args, kwargs, box, done)
    with _LOCK:  # the put and the worker's idle exit cannot interleave
        if _WORKER is None or _WORKER.stopped or not _WORKER.thread.is_alive():
            _WORKER = DeviceThread()
        _WORKER.jobs.put(job)
        CALLS += 1
    done.wait()
    if "error" in box:
        raise box.pop("error")
    return box.get("result")


def on_device_thread() -> bool:
    worker = _WORKER
    return worker is not None and threading.current_thread() is worker.thread


class FaithfulEngine:
    """Stands in for ``torch.autograd.variable.Variable._execution_engine``."""

    def __init__(self, engine):
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        if not faithful.enabled() or on_device_thread():
            return self._engine.run_backward(*args, **kwargs)  # reentrant: inline, as CUDA's engine
        return run_on_device_thread(self._engine.run_backward, args, kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def install() -> Callable[[], None]:
    from torch.autograd.variable import Variable

    engine = Variable.__dict__["_execution_engine"]
    if isinstance(engine, FaithfulEngine):
        return lambda: None
    Variable._execution_engine = FaithfulEngine(engine)

    def undo():
        Variable._execution_engine = engine

    return undo
