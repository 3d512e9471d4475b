"""What each of the overlap's two lanes keeps of the process's state, swapped at every hand-off
(lanes.py): the random generators (CPU, CUDA, the model-parallel tracker), the per-call attributes of
objects that keep state between the calls of one pass (set_stateful), and what a lane's helper thread
takes over from the calling thread (device, torch function and dispatch modes, grad mode)."""
from __future__ import annotations

import torch


def rng_snapshot():
    from megatron.core import tensor_parallel

    state = [torch.get_rng_state(), None, None, None]
    if torch.cuda.is_available():
        state[1] = torch.cuda.get_rng_state()  # the current device's (set on every lane thread)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "states_", None) is not None:
        state[2] = tracker.get_states()
        state[3] = getattr(tracker, "_current_state_name", None)
    return state


def rng_equal(a, b) -> bool:
    """Two rng_snapshot()s hold the same generator states."""
    def same(x, y):
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return all(same(x, y) for x, y in zip(a, b))


def rng_restore(state) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    if state[2] is not None:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states(dict(state[2]))
        if state[3] is not None:
            tracker._current_state_name = state[3]


# Objects that keep state between the calls of one pass (megatron's shared-expert overlap state
# machine and its cached tensors, a token dispatcher's saved indices, splits and buffers): each
# lane sees its own copy of their per-call attributes, swapped at every hand-off like the RNG.
# Without it, a recompute re-entering a MoE layer's forward inside the paired backward, or the
# two passes of a pair on the same model chunk, overwrite each other's state mid-layer.
_STATEFUL: list = []  # (object, attribute names, or None: every attribute in its __dict__)
_MISSING = object()


def set_stateful(objects) -> None:
    _STATEFUL[:] = list(objects)


def state_snapshot():
    return [(obj, dict(obj.__dict__) if attrs is None else {a: obj.__dict__.get(a, _MISSING) for a in attrs})
            for obj, attrs in _STATEFUL]


def state_restore(snapshot) -> None:
    for obj, values in snapshot:
        for k, v in values.items():
            if v is _MISSING:
                obj.__dict__.pop(k, None)
            else:
                obj.__dict__[k] = v


def inherit_thread_state(parent: dict) -> None:
    if parent["device"] is not None:
        torch.cuda.set_device(parent["device"])  # RNG snapshots, allocations: this rank's GPU
    for mode in parent["function_modes"]:
        torch._C._push_on_torch_function_stack(mode)
    for mode in parent["dispatch_modes"]:
        torch._C._push_on_torch_dispatch_stack(mode)
    torch.set_grad_enabled(parent["grad"])


def capture_thread_state() -> dict:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {
        "device": torch.cuda.current_device() if torch.cuda.is_available() else None,
        "function_modes": list(_get_current_function_mode_stack()),
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "grad": torch.is_grad_enabled(),
    }
