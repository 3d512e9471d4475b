"""Saving: the Checkpointer's save (checkpointer.py, which mixes this class in and sets the state it
reads): every --save-interval and at exit, written into ``iter_N.partial`` (for --async-save by a
forked writer), every file checksummed as it is written, then committed: the checksums into
metadata.json, the directory renamed into place, retention applied."""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import zlib

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

from megatron_ext import seams
from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import fsdp as fsdp_checkpoint
from megatron_ext.checkpoint import integrity
from megatron_ext.checkpoint import lora as ckpt_lora
from megatron_ext.checkpoint import recipe as ckpt_recipe
from megatron_ext.checkpoint import state as ckpt_state
from megatron_ext.checkpoint.model_state import gather_params, sharded_state_dict
from megatron_ext.checkpoint.options import CheckpointOptions
from megatron_ext.errors import ConfigError


class Saving:
    """The Checkpointer's save: ``after_step(i)`` after each iteration, ``close(i)`` at exit (saves
    if the last iteration is not saved yet, waits for async saves)."""

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
        if args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
            raise ConfigError(f"--ckpt-format={args.ckpt_format}: megatron_ext saves torch_dist or fsdp_dtensor only")
        t0 = time.perf_counter()
        final = ckpt_dirs.checkpoint_dir(args.save, iteration)
        partial = final + ckpt_dirs.PARTIAL
        if self.rank == 0:
            os.makedirs(args.save, exist_ok=True)
            if os.path.exists(partial):  # left by an interrupted save of the same iteration
                shutil.rmtree(partial)
            os.makedirs(partial)
        torch.distributed.barrier()
        if args.use_distributed_optimizer and args.overlap_param_gather:
            gather_params(self.model, self.optimizer)
        if not args.use_persistent_ckpt_worker:
            seams.set_write_results_queue(args.async_save, partial, self.rank)
        # the writer (this process, or the one forked for --async-save) sums every file's bytes as
        # it writes them; a persistent worker cannot be reached, its files are summed at commit
        stall = [None]  # seconds the loop waits in this call (for --async-save: until the writer is forked)
        summing = seams.checksummed_writes() if self.checksums else contextlib.nullcontext()
        with summing:
            if args.ckpt_format == "fsdp_dtensor":
                request = fsdp_checkpoint.save(self, partial, iteration)
            else:
                state = sharded_state_dict(
                    args, self.model, self.optimizer, self.scheduler, iteration, loading=False,
                    with_optimizer=not args.no_save_optim and ckpt_state.optimizer_has_state(args), with_rng=not args.no_save_rng,
                    part=ckpt_lora.save_part(args),
                )
                request = dist_checkpointing.save(
                    state, partial, self._save_strategy(), async_sharded_save=args.async_save,
                    async_strategy="mcore",
                )
            if args.async_save:
                if request.async_fn is not None and not args.use_persistent_ckpt_worker and self.checksums:
                    request = request._replace(
                        async_fn=integrity.leave_sums_after(request.async_fn, partial, self.rank))
                request.finalize_fns.append(lambda: self._commit(iteration, t0, stall))
                self._async_queue().schedule_async_request(request)  # forks the writer
                stall[0] = time.perf_counter() - t0
            else:
                self._commit(iteration, t0, stall)
        self.last_saved = iteration

    def _commit(self, iteration: int, t0: float, stall: list) -> None:
        """Runs on every rank once every rank's files and the metadata are written: the checksums
        go into the checkpoint's metadata.json, then the directory is renamed into place."""
        args = self.args
        final = ckpt_dirs.checkpoint_dir(args.save, iteration)
        partial = final + ckpt_dirs.PARTIAL
        note, stats = "", {"iteration": iteration, "commit_start_s": time.perf_counter() - t0}
        # the model it holds, beside it and checksummed with it (recipe.py)
        recipe = ckpt_recipe.record(args, partial, final) if self.rank == 0 else None
        if self.checksums:
            c0 = time.perf_counter()
            sums, write_s, writer_s = integrity.take_sums(partial, self.rank, from_sidecar=args.async_save)
            if recipe is not None:  # summed as written, as the shard files are: nothing is read back
                sums[ckpt_recipe.RECIPE] = [len(recipe), zlib.crc32(recipe), True]
            c1 = time.perf_counter()
            gathered = [None] * torch.distributed.get_world_size() if self.rank == 0 else None
            torch.distributed.gather_object((sums, write_s), gathered, dst=0)
            c2 = time.perf_counter()
            files = integrity.write_manifest(partial, [g[0] for g in gathered])[0] if self.rank == 0 else None
            stats.update(checksum_write_s=write_s, writer_s=writer_s, gather_s=c2 - c1,
                         checksum_commit_s=(c1 - c0) + (time.perf_counter() - c2))
            if self.rank == 0:
                note = (f"; {files} files checksummed ({1e3 * max(g[1] for g in gathered):.1f} ms while writing, "
                        f"{1e3 * (time.perf_counter() - c0):.1f} ms at commit)")
                if writer_s is not None:
                    note += f"; written by a forked process in {writer_s:.2f} s"
        if self.rank == 0:
            if os.path.exists(final):  # re-saving an iteration (e.g. a rerun): replace it
                ckpt_dirs.remove_dir(final)
            os.replace(partial, final)
            ckpt_dirs.fsync_dir(args.save)
            ckpt_dirs.write_atomic(os.path.join(args.save, ckpt_dirs.TRACKER), str(iteration))
            self._apply_retention(iteration)
        torch.distributed.barrier()
        stats["save_s"] = time.perf_counter() - t0
        stats["stall_s"] = stats["save_s"] if stall[0] is None else stall[0]
        self.saves.append(stats)
        self._print(f"saved checkpoint {final} at iteration {iteration} in {stats['save_s']:.2f} s{note}")

    def _apply_retention(self, newest: int) -> None:
        args = self.args
        iterations = ckpt_dirs.committed_iterations(args.save)
        keep_last = CheckpointOptions.from_args(args).save_keep_last
        keep = ckpt_dirs.retained(iterations, keep_last, args.save_retain_interval)
        for it in iterations:
            if it not in keep and it != newest:
                ckpt_dirs.remove_dir(ckpt_dirs.checkpoint_dir(args.save, it))
        for name in ckpt_dirs.debris(os.listdir(args.save), newest):
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
