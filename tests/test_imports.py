"""Importing any module of the project changes nothing in torch or megatron-core; the entry points
(train.main, the scripts' main, this suite's conftest) set the platform up. Checked in a fresh
interpreter by tests/import_probe.py, which also runs platform.setup() afterwards as the negative
control: the same probe must see what setup changes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def probe() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "scripts")]), OMP_NUM_THREADS="1")
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)  # this process's setup set it; the child starts without
    done = subprocess.run([sys.executable, "-m", "tests.import_probe", "--then-setup"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_module_is_imported(probe):
    assert {"arguments", "train", "megatron_ext.config.command_line", "megatron_ext.seams", "megatron_ext.moe.dispatcher", "megatron_ext.moe.audit",
            "megatron_ext.training.model"} <= set(probe["runtime"])
    assert "bench.gather" in probe["bench"]
    assert probe["megatron_modules_watched"] > 100  # megatron-core was imported under the watch


def test_imports_leave_torch_and_megatron_untouched(probe):
    assert probe["after_imports"] == {
        "function_modes": [], "dispatch_modes": [], "torch": [], "dynamo_disabled": False, "environ": [],
        "megatron": [],
    }


def test_runtime_does_not_import_the_measurement_package(probe):
    assert probe["bench_imported_by_runtime"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, setup applies no shim: nothing to see")
def test_probe_sees_what_setup_changes(probe):
    after = probe["after_setup"]
    assert after["function_modes"] == ["_CpuRedirectMode"]
    assert "torch.cuda.synchronize replaced" in after["torch"]
    assert "torch.distributed.all_gather replaced" in after["torch"]
    assert "megatron.core.tensor_parallel.random._get_cuda_rng_state replaced" in after["megatron"]
    assert "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__ replaced" in after["megatron"]
    assert after["dynamo_disabled"] is True and after["environ"] == ["CUDA_DEVICE_MAX_CONNECTIONS"]
