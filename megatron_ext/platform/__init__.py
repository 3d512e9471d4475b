"""CUDA+NCCL or CPU+gloo.

:func:`current` answers which device and backend this process uses and changes nothing.
:func:`setup` prepares the process once, from an entry point (``train.main``, a script's ``main``,
the test conftest), before megatron-core's models or schedules are imported: it gives this Python
environment's C++ extension builds a folder of their own (:func:`extensions_dir`); without CUDA it
applies the CPU-only shims for megatron-core (``cpu_shims/``); with CUDA it applies none and
selects this rank's device. Importing any megatron_ext module changes nothing in torch or megatron.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import sys
import typing
import warnings
from dataclasses import dataclass

import torch

from megatron_ext.platform import cpu_shims
from megatron_ext.platform.attempts import restart_count, store_prefix  # noqa: F401 (the platform's API)


@dataclass(frozen=True)
class Platform:
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_PLATFORM: Platform | None = None


def current() -> Platform:
    """Which device and backend this process uses (this rank's GPU with CUDA, else the CPU).
    Sets nothing up."""
    if _PLATFORM is not None:
        return _PLATFORM
    if torch.cuda.is_available():
        return Platform(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), "nccl")
    return Platform(torch.device("cpu"), "gloo")


def make_megatron_importable() -> None:
    """What megatron-core 0.19.2 needs to be imported at all on this machine, and nothing else:
    typing.override on Python 3.11 and, without CUDA, the stand-in module for its Triton kernels
    (cpu_shims "triton_free_paged_stash"). Changes no attribute of torch or of a loaded megatron
    module. The first step of :func:`setup`."""
    # megatron/training/models/hybrid.py uses typing.override (3.12+), reached from
    # megatron/training/arguments.py; the backfill is the same function from typing_extensions.
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    if not torch.cuda.is_available():
        cpu_shims.SHIMS["triton_free_paged_stash"].apply()


def extensions_dir() -> str:
    """Where torch builds this Python environment's C++ extensions (megatron-core compiles share_storage
    on first use; ``make install`` builds it ahead, seams/extensions.py): torch's own cache folder, one
    subfolder per environment. torch's default is one folder for every environment of a Python version
    and device kind, and the build's flags name the environment's paths: a second checkout's build
    replaced the first's, and the first then compiled it again inside a run (45 s of CPU)."""
    # megatron-core's tensor_parallel/random.py imports cpp_extension at its top: no import of its own
    from torch.utils.cpp_extension import get_default_build_root

    # torch's own subfolder name (python version, device kind), then the environment
    device = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    environment = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    return os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_{device}_"
                        f"{environment}")


def use_extensions_dir() -> None:
    """TORCH_EXTENSIONS_DIR for this process and the processes it starts: :func:`extensions_dir`, unless
    the user named one."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


def setup() -> Platform:
    """Idempotent; called by entry points only. Before megatron-core models or schedules are used."""
    global _PLATFORM
    if _PLATFORM is None:
        make_megatron_importable()
        use_extensions_dir()
        platform = current()
        if platform.is_cuda:
            torch.cuda.set_device(platform.device)
        else:
            # Expected here, and repeated by every megatron module that falls back:
            warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed")
            warnings.filterwarnings("ignore", message=".*absl.logging is not installed")
            warnings.filterwarnings("ignore", message="Apex is not installed")
            warnings.filterwarnings("ignore", message="Only transformer-engine>=1.7.0 supports MoE")
            warnings.filterwarnings("ignore", message="MimoModelConfig is experimental")

            cpu_shims.apply_all()
        _PLATFORM = platform
    return _PLATFORM


def init_distributed(timeout_s: int = 600) -> Platform:
    """setup() and, if not done yet, the default process group from torchrun's environment.

    Every key this process group (and each subgroup, which lives under it) writes into the job's
    key-value store is under :func:`store_prefix`, one per attempt. torchrun keeps its store across
    --max-restarts (torch 2.13's static and c10d rendezvous alike, TORCHELASTIC_USE_AGENT_STORE) and
    torch's env:// rendezvous adds no attempt prefix: a restarted world would find the killed
    attempt's gloo addresses under the same keys, and a rank that reads one before its peer
    rewrites it connects to a dead process (`Gloo connectFullMesh failed ... Connection refused`).
    Measured with a plain torch script too: a rank SIGKILLed under `torchrun --max-restarts 3`
    and every restart failing that way unless the ranks happened to rewrite the keys in time."""
    platform = setup()
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        timeout = datetime.timedelta(seconds=timeout_s)
        # torch's own env:// rendezvous (the store torchrun's agent hosts, or rank 0's), then
        # init_process_group as it does it, with our prefix in place of its "default_pg"
        store, rank, world_size = next(torch.distributed.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
        store = torch.distributed.PrefixStore(store_prefix(), store)
        torch.distributed.init_process_group(
            backend=platform.backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    return platform


def dump_native_crashes(rank: int | None = None) -> None:
    """faulthandler on: a native crash (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints every
    thread's Python stack to stderr, each line prefixed `[rank<R>]: ` (R: `rank`, else $RANK).

    faulthandler writes from the signal handler straight into a file descriptor, and the process
    dies right after, so the prefix is added by a small forked process that reads a pipe and
    writes each line to stderr; it ignores the launcher's SIGTERM/SIGINT (torchrun signals the
    whole process group when a rank dies) and exits once every writer has closed the pipe. Called
    once per process by entry points (train.py, the test workers), before any process group."""
    import faulthandler
    import signal

    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    read_fd, write_fd = os.pipe()
    if os.fork() == 0:  # the printer: only os-level calls, nothing of torch
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            os.closerange(3, read_fd)  # hold no copy of the process's pipes and sockets
            os.closerange(read_fd + 1, os.sysconf("SC_OPEN_MAX"))
            prefix, pending = f"[rank{rank}]: ".encode(), b""
            while True:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    os.write(2, prefix + line + b"\n")
            if pending:
                os.write(2, prefix + pending + b"\n")
        finally:
            os._exit(0)
    os.close(read_fd)
    faulthandler.enable(file=write_fd, all_threads=True)
