"""CUDA-faithful CPU mode, part (a): every backward runs on one autograd device thread per process,
as CUDA's engine runs it, carrying torch's thread-local state and not Python's thread-locals;
reentrant backwards run inline there. Removing the shim puts backward back on the caller's thread."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from megatron_ext.platform import autograd_thread, cpu_shims, faithful

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only shim (CUDA has the real engine)")

SHIM = "faithful_autograd_device_thread"
DEVICE = "autograd-device-thread"


class _Probe(torch.autograd.Function):
    """Records where its backward ran and what it saw there."""

    seen: list = []
    local = threading.local()

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _Probe.seen.append({
            "thread": threading.current_thread(),
            "local": getattr(_Probe.local, "value", None),
            "grad_enabled": torch.is_grad_enabled(),
            "function_modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
        })
        return grad * 2


def _backward_thread(call) -> threading.Thread:
    _Probe.seen.clear()
    call()
    assert len(_Probe.seen) == 1
    return _Probe.seen[0]["thread"]


@pytest.fixture
def mode_on(monkeypatch):
    monkeypatch.setenv(faithful.ENV, "1")
    assert faithful.enabled()


def _calls():
    from megatron.core.pipeline_parallel.schedules import custom_backward

    x = torch.ones(3, requires_grad=True)
    return {
        "Tensor.backward": lambda: _Probe.apply(x).sum().backward(),
        "torch.autograd.backward": lambda: torch.autograd.backward(_Probe.apply(x).sum()),
        "torch.autograd.grad": lambda: torch.autograd.grad(_Probe.apply(x).sum(), x),
        "megatron custom_backward": lambda: custom_backward(_Probe.apply(x).sum(), None),  # schedules.py:220
    }


def test_every_backward_runs_on_the_device_thread(mode_on):
    me = threading.current_thread()
    threads = {name: _backward_thread(call) for name, call in _calls().items()}
    assert all(t is not me and t.name == DEVICE for t in threads.values()), threads


def test_without_the_shim_backward_runs_on_the_callers_thread(mode_on):
    with cpu_shims.without(SHIM):
        threads = {name: _backward_thread(call) for name, call in _calls().items()}
    assert all(t is threading.current_thread() for t in threads.values())


def test_mode_off_backward_runs_on_the_callers_thread(monkeypatch):
    monkeypatch.setenv(faithful.ENV, "0")
    assert _backward_thread(_calls()["Tensor.backward"]) is threading.current_thread()


def test_torch_state_is_carried_python_thread_locals_are_not(mode_on):
    from megatron.core.pipeline_parallel.schedules import custom_backward
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    class Marker(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    _Probe.local.value = "caller's"
    try:
        x = torch.ones(3, requires_grad=True)
        y = _Probe.apply(x).sum()
        _Probe.seen.clear()
        with Count(), Marker():
            before = Count.ops
            custom_backward(y, None)  # the engine itself: no torch-function handler in between
            assert Count.ops > before  # the dispatch mode stack was carried to the device thread
    finally:
        del _Probe.local.value
    seen = _Probe.seen[0]
    assert seen["thread"].name == DEVICE and seen["thread"] is not threading.current_thread()
    assert seen["local"] is None  # threading.local is per thread: not carried, as on CUDA
    assert seen["function_modes"][-1] == "Marker"  # the torch-function mode stack was carried
    assert "_CpuRedirectMode" in seen["function_modes"]  # (the CPU shims' device rewrite too)
    assert seen["grad_enabled"] is False  # the engine runs backward nodes without grad mode


def test_reentrant_backward_runs_inline_on_the_device_thread(mode_on):
    """Recompute: megatron's CheckpointFunction re-runs the forward inside backward and calls
    torch.autograd.backward from there (tensor_parallel/random.py:656)."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    calls = autograd_thread.CALLS
    x = torch.ones(3, requires_grad=True)
    _Probe.seen.clear()
    out = CheckpointFunction.apply(lambda a: _Probe.apply(a).sin(), False, x)
    out.sum().backward()
    assert [s["thread"].name for s in _Probe.seen] == [DEVICE]
    assert autograd_thread.CALLS == calls + 1  # the inner backward ran inline
    assert torch.allclose(x.grad, 2 * torch.cos(2 * torch.ones(3)))


def test_the_device_thread_goes_away_when_idle(mode_on, monkeypatch):
    """A process holds no extra thread between steps (the test workers' leak check counts them)."""
    monkeypatch.setattr(autograd_thread, "IDLE_S", 0.05)
    thread = _backward_thread(_calls()["Tensor.backward"])
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert _backward_thread(_calls()["Tensor.backward"]).name == DEVICE  # started again on demand


def test_errors_reach_the_caller(mode_on):
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("raised in backward")

    with pytest.raises(ValueError, match="raised in backward"):
        Fails.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert _backward_thread(_calls()["Tensor.backward"]).name == DEVICE  # still served after the error
