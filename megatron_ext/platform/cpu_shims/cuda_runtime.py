"""CPU shims for megatron-core's calls into the CUDA runtime: the CUDA generator (the model-parallel RNG
tracker), streams, events, synchronize, current_device and the allocator's statistics, and the device's
compute capability read by validate_args. Each install returns its own undo (cpu_shims/__init__.py: the
records)."""
from __future__ import annotations

import contextlib
import logging

import torch

from megatron_ext.patching import set_attr as _patch
from megatron_ext.patching import undo_all as _undo_all
from megatron_ext.platform import streams


# --------------------------------------------------------------------------------------------
# RNG: megatron/core/tensor_parallel/random.py:118 (_get_cuda_rng_state), :165-174
# (_set_cuda_rng_state), :303-306 (CudaRNGStatesTracker.add), :490 (model_parallel_cuda_manual_seed)
# use the CUDA generator. On CPU the "CUDA" generator is the CPU default generator, so the
# tracker's fork/restore keeps its meaning (per-TP-rank dropout streams). Its check that the
# CPU state is unchanged inside a fork (random.py:332) then always fires: filtered, as it is
# by construction here.
# --------------------------------------------------------------------------------------------
class _DropForkWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def install_cpu_rng():
    from megatron.core.tensor_parallel import random as mrandom

    log, fork_warning = logging.getLogger(mrandom.__name__), _DropForkWarning()
    log.addFilter(fork_warning)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return _undo_all(
        [
            _patch(mrandom, "_get_cuda_rng_state", get_state),
            _patch(mrandom, "_set_cuda_rng_state", set_state),
            _patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed)),
            _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
            _patch(torch.cuda, "set_rng_state", lambda s, device="cuda": torch.set_rng_state(s)),
            lambda: log.removeFilter(fork_warning),
        ]
    )


# --------------------------------------------------------------------------------------------
# CUDA runtime calls with no CPU meaning: streams, events, synchronize, current_device.
# --------------------------------------------------------------------------------------------
# The one CPU stream/event stand-in is streams.CpuStream / CpuEvent (in the faithful mode side-stream
# work runs later on a worker, at a modelled link bandwidth); megatron-core's torch.cuda.Stream / Event
# become it, and torch.cuda.synchronize waits for every CPU stream.
_DEFAULT_STREAM = streams.host_stream()


def install_cuda_runtime_stand_ins():
    c = torch.cuda
    return _undo_all(
        [
            _patch(c, "current_device", lambda: 0),
            _patch(c, "set_device", lambda _d: None),
            _patch(c, "synchronize", lambda _d=None: streams.synchronize_all()),
            _patch(c, "Stream", streams.CpuStream),
            _patch(c, "Event", streams.CpuEvent),
            _patch(c, "current_stream", lambda _d=None: _DEFAULT_STREAM),
            _patch(c, "default_stream", lambda _d=None: _DEFAULT_STREAM),
            _patch(c, "stream", lambda _s=None: contextlib.nullcontext()),
            _patch(c, "empty_cache", lambda: None),
            _patch(c, "memory_allocated", lambda _d=None: 0),
            _patch(c, "max_memory_allocated", lambda _d=None: 0),
            _patch(c, "memory_reserved", lambda _d=None: 0),
            _patch(c, "max_memory_reserved", lambda _d=None: 0),
            _patch(c, "reset_peak_memory_stats", lambda _d=None: None),
        ]
    )


# --------------------------------------------------------------------------------------------
# megatron/training/arguments.py:1414 (validate_args, TP or CP > 1) asks for the GPU's compute
# capability via get_device_arch_version (megatron/training/utils/common_utils.py:504). A CPU
# has none: report 0 (pre-Blackwell), whose branch then asserts CUDA_DEVICE_MAX_CONNECTIONS=1
# (arguments.py:1437), a CUDA launch setting with no CPU meaning: set it.
# --------------------------------------------------------------------------------------------
def install_no_device_arch():
    import os

    from megatron.training import arguments

    old_env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    undo_arch = _patch(arguments, "get_device_arch_version", lambda: 0)

    def undo():
        undo_arch()
        if old_env is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = old_env

    return undo
