"""Distributed checkpoints with megatron-core ``dist_checkpointing``.

Save every ``--save-interval`` iterations and at exit, resume from the newest complete checkpoint
under ``--load`` (also into another parallel layout, where megatron-core reshards), saves that are
atomic, keep-last-K retention. Directory layout under ``--save`` (megatron's names):

    iter_0000020/                      complete checkpoint (dist_checkpointing format)
    iter_0000030.partial/              a save in progress, or one a crash interrupted: never loaded
    latest_checkpointed_iteration.txt  newest complete iteration, for people and tools

A save is written into ``iter_N.partial``; only after every rank's files and the metadata are on
disk (for ``--async-save``: in the finalize step, after all ranks' writer processes succeeded) does
rank 0 rename it to ``iter_N``, which is atomic on a POSIX filesystem. Resume only ever considers
``iter_N`` directories, so a crash at any point of a save leaves the previous checkpoint the one
that loads.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_ext import seams
from megatron_ext.errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
PARTIAL = ".partial"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


# ---------------------------------------------------------------------------------------------
# directory layout
# ---------------------------------------------------------------------------------------------
def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str | None) -> list[int]:
    """Iterations with a complete checkpoint under `root`, ascending. Partial saves are not listed."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _ITER_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "metadata.json")):
            found.append(int(m.group(1)))
    return sorted(found)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove_dir(path: str) -> None:
    """Rename first, so a crash half-way through deleting never leaves a half-deleted `iter_N`."""
    doomed = f"{path}.deleting"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def retained(iterations: list[int], keep_last: int | None, retain_interval: int | None) -> set[int]:
    """Which complete checkpoints retention keeps: the newest `keep_last` (--save-keep-last), plus
    every multiple of --save-retain-interval (megatron's flag: with it alone, the newest one and the
    multiples are kept). Neither flag: keep everything."""
    if keep_last is None and retain_interval is None:
        return set(iterations)
    keep = set(iterations[-(keep_last or 1):])
    if retain_interval:
        keep |= {i for i in iterations if i % retain_interval == 0}
    return keep


# ---------------------------------------------------------------------------------------------
# what a checkpoint holds
# ---------------------------------------------------------------------------------------------
def _layout(args) -> dict:
    return {
        "world_size": torch.distributed.get_world_size(),
        "tensor": args.tensor_model_parallel_size,
        "pipeline": args.pipeline_model_parallel_size,
        "virtual_pipeline": args.virtual_pipeline_model_parallel_size,
        "expert": args.expert_model_parallel_size,
        "expert_tensor": args.expert_tensor_parallel_size,
        "context": args.context_parallel_size,
    }


def _sharding_metadata(args) -> dict:
    """As megatron/training/checkpointing.py:468 (_build_sharded_state_dict_metadata) builds it.
    The distributed optimizer is saved `dp_reshardable` (DP changes only) unless
    --dist-ckpt-optim-fully-reshardable; megatron-core's own default, `fully_sharded_model_space`,
    fails with this optimizer's torch-Adam path (mapping.py:134 "flattened_range is not supported")."""
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = getattr(
                args, "distrib_optim_fully_reshardable_mem_efficient", False
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _unwrap(chunk):
    """The model under megatron-core DDP: DDP.sharded_state_dict() keys carry a `module.` prefix
    that DDP.load_state_dict() does not accept, so both directions use the unwrapped module."""
    return chunk.module if hasattr(chunk, "no_sync") else chunk


def _gather_params(model, optimizer) -> None:
    """With --overlap-param-gather the optimizer step updates only this rank's shard of each
    parameter; the other ranks' shards arrive in the next forward's pre-hooks. The model state
    saved now would hold the previous step's values there (the distributed optimizer's own `param`
    state covers only the local shard and is not what model loading reads), so gather them first,
    as megatron.training's save_checkpoint_and_time does (training.py:3045, force_param_sync).
    The next forward gathers the same values again: training is unchanged bit for bit."""
    from megatron.training.training import force_param_sync

    force_param_sync(model, optimizer=optimizer)


def _model_key(i: int) -> str:
    return f"model{i}"


def sharded_state_dict(args, model, optimizer, scheduler, iteration: int, *, loading: bool,
                       with_optimizer: bool, with_rng: bool) -> dict:
    metadata = _sharding_metadata(args)
    state = {
        "iteration": iteration,
        "consumed_samples": iteration * args.global_batch_size,
        "layout": _layout(args),
        "scheduler": scheduler.state_dict(),
        "has_rng": with_rng,
    }
    for i, chunk in enumerate(model):
        state[_model_key(i)] = _unwrap(chunk).sharded_state_dict(metadata=metadata)
    if with_optimizer:
        if loading:
            seams.ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    if with_rng:  # one object per rank (EP/TP ranks hold different tracker states)
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        state["rng_state"] = ShardedObject(
            "rng_state", _rng_state() if not loading else None, (world,), (rank,), replica_id=0
        )
    return state


# ---------------------------------------------------------------------------------------------
# the checkpointer the loop uses
# ---------------------------------------------------------------------------------------------
class Checkpointer:
    """``start = ckpt.load()`` before the loop, ``ckpt.restore_rng()`` once the data iterators
    exist; ``ckpt.after_step(i)`` after each iteration;
    ``ckpt.close(i)`` at exit (saves if the last iteration is not saved yet, waits for async)."""

    def __init__(self, args, model, optimizer, scheduler):
        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.rank = torch.distributed.get_rank()
        self.last_saved: int | None = None
        self._queue = None  # megatron-core AsyncCallsQueue (fork-based), for --async-save
        self._strategy = None
        self._pending_rng = None

    # ---- resume ----------------------------------------------------------------------------
    def load(self) -> int:
        """Load the newest complete checkpoint (or --ckpt-step) under --load; return its iteration,
        0 if there is none."""
        args = self.args
        iterations = complete_iterations(args.load)
        if not iterations:
            if args.load and args.exit_on_missing_checkpoint:
                raise ConfigError(f"--load={args.load}: no complete checkpoint (--exit-on-missing-checkpoint)")
            if args.load:
                self._print(f"no checkpoint under --load={args.load}: starting from iteration 0")
            return 0
        iteration = args.ckpt_step if args.ckpt_step is not None else iterations[-1]
        if iteration not in iterations:
            raise ConfigError(f"--ckpt-step={iteration}: no complete checkpoint in {args.load} (have {iterations})")
        path = checkpoint_dir(args.load, iteration)
        t0 = time.perf_counter()

        common = dist_checkpointing.load_common_state_dict(path)
        same_layout = common["layout"] == _layout(args)
        with_rng = same_layout and not args.no_load_rng and common.get("has_rng", False)
        with_optimizer = not args.no_load_optim and "optimizer" in common
        template = sharded_state_dict(
            args, self.model, self.optimizer, self.scheduler, iteration,
            loading=True, with_optimizer=with_optimizer, with_rng=with_rng,
        )
        strategy = get_default_load_sharded_strategy(path)
        if args.ckpt_fully_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        state = dist_checkpointing.load(template, path, strategy, strict=args.dist_ckpt_strictness)
        with torch.no_grad():  # distrib_optimizer.py:1225 copies into views of grad-tracked params
            for i, chunk in enumerate(self.model):
                _unwrap(chunk).load_state_dict(state[_model_key(i)], strict=True)
            if with_optimizer:
                self.optimizer.load_state_dict(state["optimizer"])
                seams.restore_optimizer_step(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._pending_rng = state["rng_state"] if with_rng else None
        if not same_layout:
            self._print(
                f"checkpoint layout {common['layout']} differs from this run's {_layout(args)}: "
                "resharded by dist_checkpointing; RNG state not restored"
            )
        torch.distributed.barrier()
        self.last_saved = iteration if os.path.abspath(args.load) == os.path.abspath(args.save or "") else None
        self._print(
            f"resuming from checkpoint {path} at iteration {iteration} "
            f"(consumed samples {common['consumed_samples']}; loaded in {time.perf_counter() - t0:.2f} s)"
        )
        return iteration

    def restore_rng(self) -> None:
        """Put back the loaded checkpoint's RNG states. Call after building the data iterators:
        creating a DataLoader iterator draws its base seed from the CPU generator."""
        if self._pending_rng is not None:
            _set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ---- save ------------------------------------------------------------------------------
    def after_step(self, iteration: int) -> None:
        args = self.args
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=False)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            self.save(iteration)

    def close(self, iteration: int) -> None:
        """At exit: save the final iteration unless it is saved already, then wait for async saves."""
        if self.args.save and iteration > 0 and self.last_saved != iteration:
            self.save(iteration)
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=True)
            self._queue = None

    def save(self, iteration: int) -> None:
        args = self.args
        if args.ckpt_format != "torch_dist":
            raise ConfigError(f"--ckpt-format={args.ckpt_format}: megatron_ext saves torch_dist checkpoints only")
        t0 = time.perf_counter()
        final = checkpoint_dir(args.save, iteration)
        partial = final + PARTIAL
        if self.rank == 0:
            os.makedirs(args.save, exist_ok=True)
            if os.path.exists(partial):  # left by an interrupted save of the same iteration
                shutil.rmtree(partial)
            os.makedirs(partial)
        torch.distributed.barrier()
        if args.use_distributed_optimizer and args.overlap_param_gather:
            _gather_params(self.model, self.optimizer)
        state = sharded_state_dict(
            args, self.model, self.optimizer, self.scheduler, iteration, loading=False,
            with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng,
        )
        if not args.use_persistent_ckpt_worker:
            seams.set_write_results_queue(args.async_save)
        request = dist_checkpointing.save(
            state, partial, self._save_strategy(), async_sharded_save=args.async_save,
            async_strategy="mcore",
        )
        if args.async_save:
            request.finalize_fns.append(lambda: self._commit(iteration, t0))
            self._async_queue().schedule_async_request(request)
        else:
            self._commit(iteration, t0)
        self.last_saved = iteration

    def _commit(self, iteration: int, t0: float) -> None:
        """Runs on every rank once every rank's files and the metadata are written."""
        args = self.args
        final = checkpoint_dir(args.save, iteration)
        if self.rank == 0:
            if os.path.exists(final):  # re-saving an iteration (e.g. a rerun): replace it
                _remove_dir(final)
            os.replace(final + PARTIAL, final)
            _fsync_dir(args.save)
            _write_atomic(os.path.join(args.save, TRACKER), str(iteration))
            self._apply_retention(iteration)
        torch.distributed.barrier()
        self._print(f"saved checkpoint {final} at iteration {iteration} in {time.perf_counter() - t0:.2f} s")

    def _apply_retention(self, newest: int) -> None:
        args = self.args
        iterations = complete_iterations(args.save)
        keep = retained(iterations, args.save_keep_last, args.save_retain_interval)
        for it in iterations:
            if it not in keep and it != newest:
                _remove_dir(checkpoint_dir(args.save, it))
        for name in os.listdir(args.save):  # debris of interrupted saves / deletes
            if name.endswith(".deleting") or (name.endswith(PARTIAL) and name != f"iter_{newest:07d}{PARTIAL}"):
                shutil.rmtree(os.path.join(args.save, name), ignore_errors=True)

    def _save_strategy(self):
        if self._strategy is None:
            strategy = get_default_save_sharded_strategy("torch_dist")
            strategy.use_cached_ckpt_structure = self.args.ckpt_assume_constant_structure
            if self.args.ckpt_fully_parallel_save:
                strategy = FullyParallelSaveStrategyWrapper(
                    strategy,
                    parallel_state.get_data_parallel_group(with_context_parallel=True),
                    self.args.ckpt_assume_constant_structure,
                )
            self._strategy = strategy
        return self._strategy

    def _async_queue(self):
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # default: a forked writer process per save; --use-persistent-ckpt-worker: megatron-core's
            # spawned persistent worker (GPU only, see validate())
            self._queue = AsyncCallsQueue(persistent=self.args.use_persistent_ckpt_worker)
        return self._queue

    def _print(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)



def validate(args) -> None:
    if args.save_keep_last is not None and args.save_keep_last < 1:
        raise ConfigError(f"--save-keep-last={args.save_keep_last}: keep at least 1 checkpoint")
    if (args.save or args.load) and args.ckpt_format != "torch_dist":
        raise ConfigError(f"--ckpt-format={args.ckpt_format}: megatron_ext saves and loads torch_dist only")
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval={args.save_interval}: must be >= 1")
    # megatron's validate_args (megatron/training/arguments.py:1740) turns --async-save off unless
    # --use-persistent-ckpt-worker, because megatron.training's async path needs that worker. We drive
    # megatron-core's AsyncCallsQueue ourselves, with its fork-based caller by default: honour the request.
    source = args.config_sources.get("async_save", "default")
    if source in ("cli", "recipe") or source.endswith((", cli)", ", recipe)")):  # "megatron (was True, cli)"
        args.async_save = True
    from megatron_ext import platform

    if args.async_save and args.use_persistent_ckpt_worker and not platform.current().is_cuda:
        raise ConfigError(
            "--use-persistent-ckpt-worker: not supported on CPU (the spawned worker re-imports megatron "
            "without megatron_ext's CPU shims and hangs); --async-save alone uses a forked writer per save"
        )
