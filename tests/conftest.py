import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite proves CUDA behaviour on CPU: workers inherit this (megatron_ext/platform/faithful.py).
os.environ.setdefault("MEGATRON_EXT_CUDA_FAITHFUL", "1")

from tests import dist  # noqa: E402
from megatron_ext import platform  # noqa: E402


def pytest_configure(config):
    # pytest-xdist's controller runs no test: only the processes that do start a fork server
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        return
    dist.start_server()  # the worker pools' fork server imports megatron-core while this process does
    platform.setup()
