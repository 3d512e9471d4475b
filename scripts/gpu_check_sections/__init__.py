"""The sections of ``scripts/gpu_check.py`` (its docstring says what each checks), in the order it runs
them: each is ``section_<name>(size, claims) -> dict``, run at ``size`` (the harness's SIZES, with the
section's ``time_limit_s``), appending its claims. ``child`` runs one of them as the whole of a process."""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback

from gpu_check_sections.cuda_facts import section_cuda_facts
from gpu_check_sections.fp8 import section_fp8
from gpu_check_sections.long_context import section_long_context
from gpu_check_sections.moe_graphs import section_moe_graphs
from gpu_check_sections.moe_layer import section_moe_layer
from gpu_check_sections.multihot import section_multihot
from gpu_check_sections.offload import section_offload
from gpu_check_sections.planner import section_planner
from gpu_check_sections.throughput import section_throughput
from gpu_check_sections.train_script import section_train
from gpu_check_sections.transformer_engine import section_transformer_engine


SECTIONS = ("cuda_facts", "multihot", "moe_layer", "moe_graphs", "offload", "train", "planner", "throughput",
            "transformer_engine", "fp8", "long_context")
RUNNERS = {"cuda_facts": section_cuda_facts, "multihot": section_multihot, "moe_layer": section_moe_layer,
           "moe_graphs": section_moe_graphs,
           "offload": section_offload, "train": section_train, "planner": section_planner,
           "throughput": section_throughput, "transformer_engine": section_transformer_engine,
           "fp8": section_fp8, "long_context": section_long_context}


def run_section(name: str, size: dict) -> tuple:
    """(result, claims) of ``RUNNERS[name]`` in this process (a world of one, the platform set up): a
    section that raises is reported with its traceback, never raised."""
    import torch

    from megatron_ext import platform
    from gpu_check_sections.common import single_process_env, stdout_to_stderr

    platform.setup()  # before megatron-core is imported
    claims: list = []
    with single_process_env(), stdout_to_stderr():
        started_pg = not torch.distributed.is_initialized()
        platform.init_distributed()
        try:
            result = RUNNERS[name](size, claims)
        except Exception as e:  # noqa: BLE001 - the failure is the section's result
            result = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(result["traceback"], file=sys.stderr)
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                from megatron_ext.training import parallel

                parallel.destroy()
            if started_pg and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return result, claims


def child(name: str, size: dict, result_file: str, log_file: str | None = None) -> None:
    """A section's process: its output (and, on a native crash, every thread's Python stack) into
    ``log_file`` or the inherited stderr, its result and claims into ``result_file`` (JSON, written
    whole or not at all), then the process ends without the interpreter's slow teardown."""
    if log_file is not None:
        fd = os.open(log_file, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    result, claims = run_section(name, size)
    tmp = result_file + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"result": result, "claims": claims}, f, default=str)
    os.replace(tmp, result_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
