"""CUDA+NCCL or CPU+gloo: :func:`setup` picks the device and backend once per process.

Without CUDA it applies the CPU-only shims for megatron-core (``cpu_shims.py``); with CUDA it
applies none. Either way the rest of the code is the same.
"""
from __future__ import annotations

import datetime
import os
import sys
import typing
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_PLATFORM: Platform | None = None


def _python_compat() -> None:
    # megatron/training/models/hybrid.py uses typing.override (3.12+), reached from
    # megatron/training/arguments.py; the backfill is the same function from typing_extensions.
    if not hasattr(typing, "override"):
        typing.override = lambda f: f


def setup() -> Platform:
    """Idempotent. Call before importing megatron-core models or schedules."""
    global _PLATFORM
    if _PLATFORM is None:
        _python_compat()
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            _PLATFORM = Platform(torch.device("cuda", local_rank), "nccl")
        else:
            import warnings

            from megatron_ext.platform import cpu_shims

            # Expected here, and repeated by every megatron module that falls back:
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
            warnings.filterwarnings("ignore", message=".*absl.logging is not installed")
            warnings.filterwarnings("ignore", message="Apex is not installed")
            warnings.filterwarnings("ignore", message="Only transformer-engine>=1.7.0 supports MoE")
            warnings.filterwarnings("ignore", message="MimoModelConfig is experimental")

            cpu_shims.apply_all()
            _PLATFORM = Platform(torch.device("cpu"), "gloo")
    return _PLATFORM


def init_distributed(timeout_s: int = 600) -> Platform:
    """setup() and, if not done yet, the default process group from torchrun's environment."""
    platform = setup()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group(
            backend=platform.backend, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return platform
