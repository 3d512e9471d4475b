"""Seams of checkpointing.

megatron_ext/checkpoint/ (resuming.py, saving.py) drives megatron.core.dist_checkpointing itself (not
megatron.training.checkpointing, which needs megatron's global args). Replaced or wrapped:
  distrib_optimizer.py:838 / :1032 / :1193-1225  torch-Adam `step` handling (the two functions below)
  optimizer.py:1362-1377  the `common_step` of a torch FSDP2 run's optimizer, loaded in place
    (restore_fsdp2_optimizer_step)
  filesystem_async.py:53-66 (get_write_results_queue)  the writer's result queue (set_write_results_queue)
  filesystem_async.py:407, :415 (_write_item, looked up as a module global by the writer)  wrapped
    while a save is written: each file's bytes pass through a CRC-32 (CHECKSUMMED_WRITES)
  torch's FileSystemReader.read_data, reached from serialization.py:229 and strategies/torch.py:979
    wrapped while a checkpoint loads: the files a read touches are verified first (VERIFIED_READS)
  serialization.py:151 (load_common_state_dict, looked up as a module global by load)  handed the
    common state the load read already (COMMON_STATE_GIVEN)
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import pickle
import queue
import threading
import time
import zlib

import torch
from megatron.core.dist_checkpointing import serialization
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


# ---------------------------------------------------------------------------------------------
# the running CRC-32 of every file megatron-core's writer writes (read by checkpoint/integrity.py)
# ---------------------------------------------------------------------------------------------
class _Sum:
    __slots__ = ("size", "crc", "whole", "seconds")

    def __init__(self):
        self.size, self.crc, self.whole, self.seconds = 0, 0, True, 0.0


_lock = threading.Lock()
_sums: dict[str, _Sum] = {}  # absolute path -> running sum, in the process that writes
_open: dict[int, tuple] = {}  # id(file object) -> (file object, its _Sum): one path lookup per file


def _sum_for(raw) -> _Sum:
    entry = _open.get(id(raw))
    if entry is not None and entry[0] is raw:
        return entry[1]
    with _lock:
        total = _sums.setdefault(os.path.abspath(raw.name), _Sum())
        _open[id(raw)] = (raw, total)
    return total


def start_recording() -> None:
    with _lock:
        _sums.clear()
        _open.clear()


def recorded(directory: str) -> dict:
    """{file name: [size, crc32, whole]} of the files written under `directory` since
    start_recording(); `whole` is False where some bytes did not pass through the sum. Also the
    seconds the sums took under the key None."""
    directory = os.path.abspath(directory)
    with _lock:
        mine = {p: s for p, s in _sums.items() if os.path.dirname(p) == directory}
    out = {os.path.basename(p): [s.size, s.crc, s.whole] for p, s in mine.items()}
    out[None] = sum(s.seconds for s in mine.values())
    return out


class _SummingStream:
    """The file stream megatron-core's writer hands to torch's _write_item (one per item), folding
    every byte written into the file's CRC-32. torch.save makes dozens of small writes per tensor
    (zip records), so small writes are gathered and summed and written together (fewer calls than
    without the sum); large ones go straight through. Drained when the item is written."""

    __slots__ = ("_raw", "_total", "_pending")
    SMALL = 1 << 16

    def __init__(self, raw, total: _Sum):
        self._raw, self._total, self._pending = raw, total, bytearray()

    def write(self, data):
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size < self.SMALL:
            self._pending += data
            return size
        self.drain()
        self._sum_and_write(data, size)
        return size

    def drain(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._sum_and_write(pending, len(pending))

    def _sum_and_write(self, data, size: int) -> None:
        total = self._total
        t0 = _clock()
        total.crc = zlib.crc32(data, total.crc)
        total.seconds += _clock() - t0
        if self._raw.write(data) != size:  # a short raw write: the sum is not the file's any more
            total.whole = False
        total.size += size

    def tell(self) -> int:
        return self._raw.tell() + len(self._pending)

    def flush(self) -> None:
        self.drain()
        self._raw.flush()

    def __getattr__(self, name):
        return getattr(self._raw, name)


_clock = time.perf_counter


def summing_write_item(original):
    """Wrap torch's `_write_item(transforms, stream, data, write_item, storage_key, ...)` as
    megatron-core calls it (filesystem_async.py:404-418, positionally) so the file's bytes pass
    through a sum."""
    position = list(inspect.signature(original).parameters).index("stream")

    @functools.wraps(original)  # megatron-core inspects the signature (filesystem_async.py:394)
    def write_item(*args, **kwargs):
        positional = len(args) > position
        raw = args[position] if positional else kwargs["stream"]
        total = _sum_for(raw)
        if raw.tell() != total.size:  # bytes written around us: the sum would not be the file's
            total.whole = False
        stream = _SummingStream(raw, total)
        if positional:
            args = (*args[:position], stream, *args[position + 1:])
        else:
            kwargs["stream"] = stream
        result = original(*args, **kwargs)
        stream.drain()
        return result

    return write_item


def _install_checksummed_writes():
    return set_attr(filesystem_async, "_write_item", summing_write_item(filesystem_async._write_item))


CHECKSUMMED_WRITES = Patch(
    "checkpointing.checksummed_writes",
    ["megatron/core/dist_checkpointing/strategies/filesystem_async.py:407",
     "megatron/core/dist_checkpointing/strategies/filesystem_async.py:415"],
    "megatron-core's writer calls torch's _write_item by its module-global name, once per item of a "
    "shard file: the wrapper hands it a stream that folds every byte into the file's CRC-32 "
    "(summing_write_item; checkpoint/integrity.py records them), so the checksum costs no second read",
    _install_checksummed_writes,
)


@contextlib.contextmanager
def checksummed_writes():
    """CHECKSUMMED_WRITES for one save: while it is written, and while its --async-save writer is
    forked (the child keeps it)."""
    start_recording()
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
_GIVEN: list = []  # (directory, common state) of the loads in progress


def _install_common_state_given():
    original = serialization.load_common_state_dict

    def load_common_state_dict(checkpoint_dir):
        if _GIVEN and os.path.abspath(str(checkpoint_dir)) == _GIVEN[-1][0]:
            return copy.deepcopy(_GIVEN[-1][1])  # a copy: load merges the loaded tensors into it
        return original(checkpoint_dir)

    return set_attr(serialization, "load_common_state_dict", load_common_state_dict)


COMMON_STATE_GIVEN = Patch(
    "checkpointing.common_state_given",
    ["megatron/core/dist_checkpointing/serialization.py:151"],
    "dist_checkpointing.load reads the checkpoint's common state (load_common_state_dict, a module "
    "global) that its caller read to build the load's template: it is handed that one instead of "
    "reading (and verifying) it a second time",
    _install_common_state_given,
)
SEAMS = [CHECKSUMMED_WRITES, VERIFIED_READS, COMMON_STATE_GIVEN]


@contextlib.contextmanager
def verified_reads(verifier):
    """VERIFIED_READS for one load, checking against `verifier` (ckpt_integrity.Verifier)."""
    _VERIFIERS.append(verifier)
    try:
        with VERIFIED_READS.applied():
            yield
    finally:
        _VERIFIERS.pop()


@contextlib.contextmanager
def common_state_given(directory: str, common: dict):
    """COMMON_STATE_GIVEN for one load of `directory`, whose common state the caller read: `common`."""
    _GIVEN.append((os.path.abspath(directory), common))
    try:
        with COMMON_STATE_GIVEN.applied():
            yield
    finally:
        _GIVEN.pop()
