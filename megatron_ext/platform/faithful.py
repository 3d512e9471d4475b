"""The CUDA-faithful CPU mode: on a machine without CUDA, reproduce the CUDA/NCCL behaviours that
this project's scheduling depends on, so a CPU test proves what will happen on GPUs.

What it simulates (each part lives beside the stand-in it changes):
  * backward on the autograd engine's device thread, not the caller's;
  * device work that completes later than the host enqueues it (copies bounded by a host link);
  * NCCL point-to-point order: per communicator, ops complete in issue order and a send completes
    only once the peer has posted the matching recv.

The switch is the environment variable below, read at call time so that spawned workers inherit
it; the test suite turns it on. With CUDA present the mode is always off: the real device rules.
"""
from __future__ import annotations

import os

import torch

ENV = "MEGATRON_EXT_CUDA_FAITHFUL"


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1" and not torch.cuda.is_available()


# The host link of the CPU copy engine (platform/streams.py). Default: a link that is to this kind of
# CPU what PCIe Gen5 x16 (~50 GB/s D2H) is to an H100's HBM3 (~3.35 TB/s), about 1/64 of memory
# bandwidth: a 2-core CPU copies ~7 GB/s, so ~0.1 GB/s. Read at call time (a job may change it).
LINK_ENV = "MEGATRON_EXT_LINK_GBPS"
DEFAULT_LINK_GBPS = 0.1


def link_gbps() -> float:
    """Bandwidth of each direction of the modelled host link, in GB/s (1e9 bytes/s); 'inf': no limit."""
    return float(os.environ.get(LINK_ENV, DEFAULT_LINK_GBPS))
