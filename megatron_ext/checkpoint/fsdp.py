"""Megatron-FSDP checkpoints in megatron's fsdp_dtensor format, inside the Checkpointer's directory
layout, atomic commit, retention and integrity (saving.py, dirs.py,
integrity.py); the common and RNG state as state.py builds it for both formats.

As Megatron-LM saves them (megatron/training/checkpointing.py:841-891, 1761-1812): the model's
state dict of DTensors (each rank holds its shard of every parameter) and the optimizer's
`fsdp_dtensor` sharded state dict, prepared by megatron's preprocess_fsdp_dtensor_state_dict
(SwiGLU's fused fc1 split into its two halves, expert keys, uneven-shard metadata), written in
torch.distributed.checkpoint's format by megatron-core's writer and read by torch's reader. Beside them, in the same directory:

    metadata.json       {"sharded_backend": "fsdp_dtensor", "megatron_ext": {iteration, consumed
                        samples, parallel layout, LR scheduler, ...}}; at commit the checksums of
                        every file are added to it, as for torch_dist checkpoints
    rng_state.<r>.pt    rank r's RNG states (Python, NumPy, torch, the model-parallel tracker)

Every file is checksummed as written (megatron-core's writer through seams.checksummed_writes, the
rest at commit) and
verified before a load reads it.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader

from megatron_ext import seams
from megatron_ext.checkpoint import state as ckpt_state
from megatron_ext.checkpoint.integrity import CONFIG

RNG = "rng_state.{rank}.pt"


def _state(ckpt, *, loading: bool, with_optimizer: bool) -> dict:
    (chunk,) = ckpt.model  # Megatron-FSDP has no pipeline stages (model.before_validate)
    state = {"model": chunk.state_dict_for_save_checkpoint()}
    if with_optimizer:
        seams.complete_fsdp_optimizer_state(ckpt.optimizer)  # loading: megatron materialises the optimizer's state with a zero step
        state["optimizer"] = ckpt.optimizer.sharded_state_dict(
            state, is_loading=loading, metadata=ckpt_state.sharding_metadata(ckpt.args))
    return state


class _ParameterNames:
    """The model as megatron's SwiGLU split looks parameters up (fsdp_dtensor_checkpoint.py:343 and
    :375): model keys are named under the Megatron-FSDP module and looked up as `module.<key>`
    from the adapter; optimizer keys are named from the adapter and looked up less their first
    `module.`, i.e. from the Megatron-FSDP module. With Float16Module in between the two agree;
    in fp32 they are one level apart. Each name is resolved from the adapter, else one level in."""

    def __init__(self, adapter):
        self.adapter, self.config = adapter, adapter.config

    def named_modules(self, *args, **kwargs):
        return self.adapter.named_modules(*args, **kwargs)

    def get_parameter(self, name: str):
        try:
            return self.adapter.get_parameter(name)
        except AttributeError:
            return self.adapter.module.get_parameter(name)


def _prepared(args, state: dict, chunk) -> dict:
    from megatron.training.checkpointing import preprocess_fsdp_dtensor_state_dict

    return preprocess_fsdp_dtensor_state_dict(args, state, _ParameterNames(chunk))


def save(ckpt, directory: str, iteration: int):
    """Write the checkpoint into `directory` (the `.partial` one the Checkpointer commits). The
    tensors go through megatron-core's writer, as Megatron-LM's --async-save path does
    (checkpointing.py:918-957), and as every torch_dist save here does: its writes are the ones
    seams.checksummed_writes() sums. With --async-save they are planned here and written by the
    returned AsyncRequest; without it the request runs now and None is returned."""
    args, rank = ckpt.args, torch.distributed.get_rank()
    state = _state(ckpt, loading=False, with_optimizer=not args.no_save_optim and ckpt_state.optimizer_has_state(args))
    prepared = _prepared(args, state, ckpt.model[0])
    request = _write_request(prepared, directory)
    if not args.async_save:
        request.execute_sync()
        request = None
    if not args.no_save_rng:
        torch.save(ckpt_state.rng_state(), os.path.join(directory, RNG.format(rank=rank)))
    if rank == 0:
        common = {**ckpt_state.common_state(args, ckpt.scheduler, iteration, with_rng=not args.no_save_rng),
                  "has_optimizer": not args.no_save_optim and ckpt_state.optimizer_has_state(args)}
        with open(os.path.join(directory, CONFIG), "w") as f:
            json.dump({"sharded_backend": "fsdp_dtensor", "megatron_ext": common}, f)
    torch.distributed.barrier()
    return request


def _write_request(prepared: dict, directory: str):
    """Plan the save now (a collective); the returned request writes the files (in a forked process
    under --async-save) and, on every rank once all have written, writes torch's .metadata."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
        save_state_dict_async_finalize, save_state_dict_async_plan)

    writer = FileSystemWriterAsync(directory)
    planned = save_state_dict_async_plan(prepared, writer, None, 0, planner=DefaultSavePlanner())[0]
    write_fn, preload_fn, write_args = writer.get_save_function_and_args()
    return AsyncRequest(write_fn, write_args, [lambda: save_state_dict_async_finalize(*planned)],
                        preload_fn=preload_fn)


def load(ckpt, path: str, iteration: int, verifier) -> tuple[dict, dict | None]:
    """Load `path` into the model, optimizer and scheduler (the files verified as they are read).
    Returns the checkpoint's common state and this rank's saved RNG states (None when they are not
    to be restored), which the caller puts back once the data iterators exist."""
    args, rank = ckpt.args, torch.distributed.get_rank()
    common = verifier.config["megatron_ext"]  # metadata.json, as the Verifier's inspect() read (and verified) it
    # --finetune: the model weights only, as megatron's load_checkpoint (fresh optimizer, schedule, RNG)
    with_rng = (common["layout"] == ckpt_state.layout(args) and not args.no_load_rng and not args.finetune
                and common["has_rng"])
    with_optimizer = ckpt._optimizer_to_load(path, common["has_optimizer"])
    state = _state(ckpt, loading=True, with_optimizer=with_optimizer)
    raw = dict(state)  # the preprocessing rewrites keys; the load fills the same tensors in place
    prepared = _prepared(args, {k: dict(v) for k, v in state.items()}, ckpt.model[0])
    dcp.load_state_dict(prepared, storage_reader=FileSystemReader(path),
                        planner=DefaultLoadPlanner(allow_partial_load=False))
    with torch.no_grad():
        ckpt.model[0].load_state_dict(raw["model"], strict=True)
        if with_optimizer:
            ckpt.optimizer.load_state_dict(raw["optimizer"])
    if not args.finetune:
        ckpt.scheduler.load_state_dict(common["scheduler"])
    if with_rng:
        name = RNG.format(rank=rank)
        if verifier.files is not None:
            verifier.verify_read({name})  # collective: each rank its own file
        return common, torch.load(os.path.join(path, name), weights_only=False)
    return common, None
