"""CPU shims that rewrite what megatron-core asks of CUDA devices and CUDA tensors (device='cuda',
.cuda(), record_stream, pin_memory, Tensor.type()'s CUDA names) into its CPU meaning, with one
TorchFunctionMode whose rules the shims switch on (cpu_shims/__init__.py: the records)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


# --------------------------------------------------------------------------------------------
# Hard-coded CUDA devices and CUDA-only tensor methods, rewritten by one TorchFunctionMode.
# --------------------------------------------------------------------------------------------
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuRedirectMode(TorchFunctionMode):
    """Rewrites what megatron-core asks of CUDA into its CPU meaning. Rules are switched on by
    the shims' records (cpu_shims/__init__.py); with no rule on, the mode passes every call through
    untouched."""

    rules: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every torch call of the process passes here: the common one (no rule of it applies) costs a
        # set lookup and returns
        if func not in _RULED and (not kwargs or ("device" not in kwargs and "pin_memory" not in kwargs)):
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        rules = self.rules
        if "device" in rules:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.device and args and _is_cuda_device(args[0]):  # `with torch.device(cuda)`
                return torch.device("cpu")
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu") + tuple(args[2:])
        if "cuda_only_methods" in rules:
            if func is torch.Tensor.record_stream:
                return None
            if func is torch.Tensor.pin_memory:
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        if "tensor_type_names" in rules and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # The mode is suspended inside its own handler, but the Python backward functions of
            # megatron's autograd Functions must see it: run the engine directly, mode on.
            with self:
                return _run_backward(func, *args, **kwargs)
        return func(*args, **kwargs)


# the functions a rule of the mode rewrites whatever their keyword arguments
_RULED = frozenset({torch.Tensor.cuda, torch.device, torch.Tensor.to, torch.Tensor.record_stream,
                    torch.Tensor.pin_memory, torch.Tensor.type, torch.autograd.backward, torch.Tensor.backward})


def _run_backward(func, *args, **kwargs):
    """torch.autograd.backward / Tensor.backward without re-dispatching to the mode (which would
    recurse): the same argument handling, then the autograd engine itself."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        bound = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs"), args))
        bound.update({"grad_tensors" if k == "gradient" else k: v for k, v in kwargs.items()})
    else:
        bound = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"), args))
        bound.update(kwargs)
    tensors = (bound["tensors"],) if torch.is_tensor(bound["tensors"]) else tuple(bound["tensors"])
    grads = _tensor_or_tensors_to_tuple(bound.get("grad_tensors"), len(tensors))
    grads = _make_grads(tensors, grads, is_grads_batched=False)
    create_graph = bool(bound.get("create_graph"))
    retain_graph = create_graph if bound.get("retain_graph") is None else bound["retain_graph"]
    inputs = bound.get("inputs")
    inputs = () if inputs is None else ((inputs,) if torch.is_tensor(inputs) else tuple(inputs))
    _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


_MODE: _CpuRedirectMode | None = None


def mode_rule(rule: str):
    def install():
        global _MODE
        if _MODE is None:
            _MODE = _CpuRedirectMode()
            _MODE.__enter__()
        _CpuRedirectMode.rules = _CpuRedirectMode.rules | {rule}

        def undo():
            _CpuRedirectMode.rules = _CpuRedirectMode.rules - {rule}

        return undo

    return install
