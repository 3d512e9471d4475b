"""Seams of checkpointing.

megatron_ext/training/checkpointing.py drives megatron.core.dist_checkpointing itself (not
megatron.training.checkpointing, which needs megatron's global args). Replaced or wrapped:
  distrib_optimizer.py:838 / :1032 / :1193-1225  torch-Adam `step` handling (the two functions below)
  filesystem_async.py:53-66 (get_write_results_queue)  the writer's result queue (set_write_results_queue)
"""
from __future__ import annotations

import multiprocessing as mp
import queue

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer


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


def set_write_results_queue(async_save: bool) -> None:
    """Choose the queue megatron-core's checkpoint writer reports its results through.

    megatron/core/dist_checkpointing/strategies/filesystem_async.py:53-66 (get_write_results_queue,
    called at :200 when a save is planned) creates one process-wide `spawn` Manager queue, built for
    the spawned persistent writer. That starts a server process on the first save (which re-imports
    the launching script, and which a daemonic process may not start at all). Without the persistent
    worker we set the module global `_results_queue` before each save: a plain queue.Queue for a
    synchronous save (the write runs in this process), a fork-context multiprocessing queue for the
    forked async writer. A writer already in flight keeps the queue it was planned with."""
    filesystem_async._results_queue = mp.get_context("fork").Queue() if async_save else queue.Queue()
