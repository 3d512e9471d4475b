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
