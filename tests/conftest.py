import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite proves CUDA behaviour on CPU: workers inherit this (megatron_ext/platform/faithful.py).
os.environ.setdefault("MEGATRON_EXT_CUDA_FAITHFUL", "1")

import pytest  # noqa: E402

from tests import dist, tiers  # noqa: E402


def pytest_configure(config):
    # pytest-xdist's controller runs no test: only the processes that do start a fork server (and
    # import torch: the controller's workers start seconds sooner without it)
    if getattr(config, "workerinput", None) is None and getattr(config.option, "numprocesses", None):
        return
    dist.start_server()  # the worker pools' fork server imports megatron-core while this process does
    from megatron_ext import platform

    platform.setup()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks this adds
def pytest_collection_modifyitems(config, items):
    whole = [os.path.abspath(str(a)) for a in config.args] == [os.path.join(str(config.rootpath), "tests")]
    tiers.apply(items, whole_suite=whole)
