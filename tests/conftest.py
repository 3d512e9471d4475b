import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite proves CUDA behaviour on CPU: workers inherit this (megatron_ext/platform/faithful.py).
os.environ.setdefault("MEGATRON_EXT_CUDA_FAITHFUL", "1")

from tests import dist  # noqa: E402

dist.start_server()  # the worker pools' fork server imports megatron-core while this process does

from megatron_ext import platform  # noqa: E402

platform.setup()
