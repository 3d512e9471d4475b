"""Seams of checkpointing.

megatron_ext/training/checkpointing.py drives megatron.core.dist_checkpointing itself (not
megatron.training.checkpointing, which needs megatron's global args). Replaced or wrapped:
  distrib_optimizer.py:838 / :1032 / :1193-1225  torch-Adam `step` handling (the two functions below)
  optimizer.py:1362-1377  the `common_step` of a torch FSDP2 run's optimizer, loaded in place
    (restore_fsdp2_optimizer_step)
  filesystem_async.py:53-66 (get_write_results_queue)  the writer's result queue (set_write_results_queue)
  filesystem_async.py:407, :415 (_write_item, looked up as a module global by the writer)  wrapped
    while a save is written: each file's bytes pass through a CRC-32 (CHECKSUMMED_WRITES)
  torch's FileSystemReader.read_data, reached from serialization.py:229 and strategies/torch.py:979
    wrapped while a checkpoint loads: the files a read touches are verified first (VERIFIED_READS)
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from torch.distributed.checkpoint.filesystem import FileSystemReader

from megatron_ext.patching import Patch, set_attr


def _torch_optimizers(optimizer):
    """(megatron optimizer, inner torch optimizer) pairs under a possibly chained optimizer."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield opt, inner


def ensure_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer (no step taken yet) its Adam state before the load template is built.

    megatron/core/optimizer/distrib_optimizer.py:838-840 (DistributedOptimizer.state_dict, reached
    from sharded_state_dict(is_loading=True) at :1460) reads `step` from every param's torch-Adam
    state and asserts it is one value: a fresh optimizer has no state. The optimizer's own
    init_state_fn (megatron/core/optimizer/__init__.py:588) creates exp_avg/exp_avg_sq but no
    `step`; we add step=0 (overwritten by the load). Non-distributed optimizers call init_state_fn
    themselves (optimizer.py:1362) and are left alone."""
    for opt, inner in _torch_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer) or len(inner.state) > 0:
            continue
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def restore_optimizer_step(optimizer, loaded_state) -> None:
    """After DistributedOptimizer.load_state_dict, make every param's torch-Adam `step` the
    checkpoint's step.

    megatron/core/optimizer/distrib_optimizer.py:1032 puts the checkpoint's step (saved in
    param_groups, :838) into the packed state, but the parameter-state load that follows (:1084
    load_parameter_state_from_dp_reshardable -> :1193-1225 _set_main_param_and_optimizer_states)
    copies every tensor of the current per-param state, `step` included, from the loaded shards, and
    the per-param step does not come back as the true one: without this, the tiny GPT's losses after
    a resume differ from iteration 2 after the resume on (measured). The step held in the loaded
    param_groups is the true one."""
    del loaded_state  # the loaded param_groups are already in the inner optimizer
    for opt, inner in _torch_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if p in inner.state:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def restore_fsdp2_optimizer_step(optimizer, loaded_state) -> None:
    """After a torch_dist load under torch FSDP2, give every param's torch-Adam state the
    checkpoint's step.

    As megatron/training/training.py:2204 does (skip_load_to_model_and_opt for FSDP2 + torch_dist),
    the load writes the model's and the optimizer's tensors in place (their ShardedTensors hold the
    DTensors' local shards) and neither load_state_dict runs: torch's Optimizer.load_state_dict
    would replace each DTensor state by the loaded local tensor. The step is not one of those
    tensors: sharded_state_dict saves it once as `common_step` (optimizer.py:1362-1377 fp32;
    :1138-1189 mixed precision, whose fp32 main params load in place too), and a fresh optimizer's
    init_state_fn (optimizer/__init__.py:588) makes no per-param step to load it into."""
    pairs = list(_torch_optimizers(optimizer))
    loaded = [loaded_state] if len(pairs) == 1 else [loaded_state[i] for i in range(len(pairs))]
    for (_, inner), state in zip(pairs, loaded):
        if "state" not in state:  # mixed precision: {"optimizer": ..., "fp32_from_fp16_params": ...}
            state = state["optimizer"]
        step = state["state"].get("common_step")
        if step is None:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p in inner.state:
                    inner.state[p]["step"] = torch.as_tensor(step, dtype=torch.float32).clone()


class _FileResultsQueue:
    """The forked writer's results, handed over through a file in the checkpoint directory.

    A multiprocessing queue cannot carry them: its feeder thread must flush into a pipe before the
    writer process may exit, and that pipe is read only in the finalize step, which waits until
    the writer has exited (async_utils.py:305 is_alive, then filesystem_async.py:462 get_nowait).
    Past the pipe's 64 KiB the writer never exits: measured with an fsdp_dtensor save, whose write
    results name every DTensor item. A file has no such limit."""

    def __init__(self, directory: str, rank: int):
        self.path = os.path.join(directory, f".write_results.{rank}.pkl")

    def put(self, results) -> None:  # in the writer process
        with open(self.path + ".tmp", "wb") as f:
            pickle.dump(results, f)
        os.replace(self.path + ".tmp", self.path)

    def get_nowait(self):  # in the training process, once the writer has exited
        try:
            with open(self.path, "rb") as f:
                results = pickle.load(f)
        except FileNotFoundError:
            raise queue.Empty from None
        os.remove(self.path)
        return results


def set_write_results_queue(async_save: bool, directory: str, rank: int) -> None:
    """Choose the queue megatron-core's checkpoint writer reports its results through.

    megatron/core/dist_checkpointing/strategies/filesystem_async.py:53-66 (get_write_results_queue,
    called at :200 when a save is planned) creates one process-wide `spawn` Manager queue, built for
    the spawned persistent writer. That starts a server process on the first save (which re-imports
    the launching script, and which a daemonic process may not start at all). Without the persistent
    worker we set the module global `_results_queue` before each save: a plain queue.Queue for a
    synchronous save (the write runs in this process), a file in the save's directory for the
    forked async writer (_FileResultsQueue). A writer already in flight keeps the queue it was
    planned with."""
    filesystem_async._results_queue = _FileResultsQueue(directory, rank) if async_save else queue.Queue()


def _install_checksummed_writes():
    from megatron_ext.training import ckpt_integrity

    return set_attr(filesystem_async, "_write_item", ckpt_integrity.summing_write_item(filesystem_async._write_item))


CHECKSUMMED_WRITES = Patch(
    "checkpointing.checksummed_writes",
    ["megatron/core/dist_checkpointing/strategies/filesystem_async.py:407",
     "megatron/core/dist_checkpointing/strategies/filesystem_async.py:415"],
    "megatron-core's writer calls torch's _write_item by its module-global name, once per item of a "
    "shard file: the wrapper hands it a stream that folds every byte into the file's CRC-32 "
    "(megatron_ext/training/ckpt_integrity.py), so the checksum costs no second read",
    _install_checksummed_writes,
)


@contextlib.contextmanager
def checksummed_writes():
    """CHECKSUMMED_WRITES for one save: while it is written, and while its --async-save writer is
    forked (the child keeps it)."""
    from megatron_ext.training import ckpt_integrity

    ckpt_integrity.start_recording()
    with CHECKSUMMED_WRITES.applied():
        yield


_VERIFIERS: list = []


def _install_verified_reads():
    original = FileSystemReader.__dict__["read_data"]

    def read_data(self, plan, planner):
        verifier = _VERIFIERS[-1] if _VERIFIERS else None
        if verifier is not None and os.path.abspath(str(self.path)) == verifier.directory:
            verifier.verify_read({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return original(self, plan, planner)

    return set_attr(FileSystemReader, "read_data", read_data)


VERIFIED_READS = Patch(
    "checkpointing.verified_reads",
    ["megatron/core/dist_checkpointing/serialization.py:229",
     "megatron/core/dist_checkpointing/strategies/torch.py:979"],
    "torch's FileSystemReader.read_data (torch/distributed/checkpoint/filesystem.py:861), which "
    "dist_checkpointing reaches once per rank from load_common_state_dict and once per base load "
    "(twice under the fully parallel load), first verifies the files the read plan touches: exactly "
    "the files this rank reads. Every rank reaches each read, so the ranks agree there, before any "
    "byte is read",
    _install_verified_reads,
)
SEAMS = [CHECKSUMMED_WRITES, VERIFIED_READS]


@contextlib.contextmanager
def verified_reads(verifier):
    """VERIFIED_READS for one load, checking against `verifier` (ckpt_integrity.Verifier)."""
    _VERIFIERS.append(verifier)
    try:
        with VERIFIED_READS.applied():
            yield
    finally:
        _VERIFIERS.pop()
