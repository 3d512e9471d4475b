"""Distributed checkpoints with megatron-core ``dist_checkpointing``.

Save every ``--save-interval`` iterations and at exit, resume from the newest complete checkpoint
under ``--load`` (also into another parallel layout, where megatron-core reshards), saves that are
atomic, keep-last-K retention. The directories under ``--save`` and what retention keeps:
dirs.py; what a checkpoint holds of the model: model_state.py; the common state and RNG states
every format records: state.py; the flags' checks: options.py; --load read ahead of a run: reading.py.

A save is written into ``iter_N.partial``; only after every rank's files and the metadata are on
disk (for ``--async-save``: in the finalize step, after all ranks' writer processes succeeded) does
rank 0 rename it to ``iter_N``, which is atomic on a POSIX filesystem. Resume only ever considers
``iter_N`` directories, so a crash at any point of a save leaves the previous checkpoint the one
that loads. A run that resumes from its own --save directory (a restart after a rank was killed)
removes what the killed run's saves left behind (`.partial`, `.deleting`) before it loads.

Integrity (integrity.py): every file's CRC-32 is taken from the bytes as they are written and
recorded in the checkpoint's metadata.json at commit; a resume verifies every file it reads before
using it (and that none is missing). A damaged checkpoint is named in one line and the newest
intact older one loads instead, or, with --no-ckpt-fallback, the run stops there.
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
import time
import zlib

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)

from megatron_ext import seams
from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import fsdp as fsdp_checkpoint
from megatron_ext.checkpoint import integrity
from megatron_ext.checkpoint import lora as ckpt_lora
from megatron_ext.checkpoint import recipe as ckpt_recipe
from megatron_ext.checkpoint import state as ckpt_state
from megatron_ext.checkpoint import te_names
from megatron_ext.checkpoint.model_state import (
    gather_params,
    load_model_state,
    model_key,
    non_finite_parameters,
    onto_checkpoint_names,
    sharded_state_dict,
    unwrap,
)
from megatron_ext.checkpoint.options import options_from_args as ckpt_options
from megatron_ext.errors import ConfigError


class DamagedCheckpoint(ConfigError):
    """The checkpoint to resume from failed verification and no older one is to be loaded
    (--no-ckpt-fallback, --ckpt-step, or none intact): one line naming the checkpoint and files,
    raised on every rank before any compute, like a refused flag."""


# ---------------------------------------------------------------------------------------------
# --finetune from torch_dist into a Megatron-FSDP model
# ---------------------------------------------------------------------------------------------
_LOADED_BEFORE_SHARDING: dict[int, list] = {}  # id(args) -> the lines the loop's load prints


class WeightsOnly:
    """The schedule of a checkpoint that holds model weights only (an import, or a weights-only
    load): it saves none, and such a checkpoint loads with --finetune, which starts a fresh one."""

    def state_dict(self):
        return None

    def load_state_dict(self, state):  # pragma: no cover - --finetune skips it
        raise ConfigError("an imported checkpoint holds model weights only: load it with --finetune")


def load_before_sharding(args, chunks: list) -> None:
    """--finetune --load of a torch_dist checkpoint (an import from Hugging Face, a DDP run) into a
    Megatron-FSDP model, which loads fsdp_dtensor only: the weights load into the model
    megatron-core built, through the same sharded_state_dict (and resharding) as any other layout,
    before Megatron-FSDP shards it; the loop's load then prints what was loaded. Call on every rank
    before wrapping."""
    if not (args.use_megatron_fsdp and args.finetune and args.load):
        return
    listing = [None]
    if torch.distributed.get_rank() == 0:
        iterations = ckpt_dirs.committed_iterations(args.load) if os.path.isdir(args.load) else []
        pick = args.ckpt_step if args.ckpt_step is not None else (iterations[-1] if iterations else None)
        found = None
        if pick is not None and pick in iterations:
            config = integrity.read_config(ckpt_dirs.checkpoint_dir(args.load, pick))[0]
            found = (config or {}).get("sharded_backend")  # unreadable: the loop's load names the damage
        listing = [found]
    torch.distributed.broadcast_object_list(listing, src=0)
    if listing[0] != "torch_dist":
        return  # fsdp_dtensor (the loop loads it), or nothing to load (the loop says so)
    if args.init_model_with_meta_device:
        raise ConfigError(f"--init-model-with-meta-device=True cannot be combined with --finetune --load={args.load}: "
                          "a torch_dist checkpoint loads into the model before Megatron-FSDP shards it, "
                          "and a model built on the meta device has no storage to load into")
    plain = copy.copy(args)
    plain.use_megatron_fsdp, plain.ckpt_format, plain.auto_detect_ckpt_format, plain.save = False, "torch_dist", False, None
    ckpt = Checkpointer(plain, chunks, None, WeightsOnly())
    lines = _LOADED_BEFORE_SHARDING.setdefault(id(args), [])
    ckpt._print = lines.append
    ckpt.load()
    lines.append("the torch_dist weights were loaded before Megatron-FSDP sharded the model")


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
        self.checksums = True  # benchmarks turn it off to measure what the checksums cost
        self.saves: list[dict] = []  # per save on this rank: seconds, and the checksums' share
        self.loaded: dict | None = None  # the load's seconds and the verification's share

    # ---- resume ----------------------------------------------------------------------------
    def load(self) -> int:
        """Load the newest intact checkpoint (or --ckpt-step) under --load; return its iteration,
        0 if there is none. Every file is verified before it is used (integrity.py); a damaged
        checkpoint is named in one line and the next older intact one loads instead, unless
        --no-ckpt-fallback (or --ckpt-step) asks for exactly that one."""
        args = self.args
        if not args.load:
            return self._load_pretrained()
        preloaded = _LOADED_BEFORE_SHARDING.pop(id(args), None)
        if preloaded is not None:  # load_before_sharding
            for line in preloaded:
                self._print(line)
            return 0
        if self.rank == 0 and args.save and os.path.abspath(args.load) == os.path.abspath(args.save):
            for name in ckpt_dirs.remove_interrupted(args.load):  # nothing of this run is being written yet
                self._print(f"removed {os.path.join(args.load, name)}: a save or delete a killed run left unfinished")
        first = ckpt_dirs.handed(args)  # what --load's first reader found (a conversion's), else None
        iterations, tracker_note = self._listing(first)
        if tracker_note:
            self._print(f"warning: {tracker_note}: ignored; the newest checkpoint is found by listing {args.load}")
        if not iterations and args.pretrained_checkpoint:
            return self._load_pretrained()
        if not iterations:
            if args.exit_on_missing_checkpoint:
                raise ConfigError(f"--load={args.load}: no complete checkpoint (--exit-on-missing-checkpoint)")
            self._print(f"no checkpoint under --load={args.load}: starting from iteration 0")
            return 0
        if args.ckpt_step is not None:
            if args.ckpt_step not in iterations:
                raise ConfigError(f"--ckpt-step={args.ckpt_step}: no complete checkpoint in {args.load} (have {iterations})")
            candidates = [args.ckpt_step]
        else:
            candidates = iterations[::-1]
        for iteration in candidates:
            path = ckpt_dirs.checkpoint_dir(args.load, iteration)
            damage, loaded = self._load_verified(path, iteration, first)
            if damage is None:
                if iteration != iterations[-1] and args.ckpt_step is None:
                    lost = iterations[-1] - iteration
                    self._print(
                        f"warning: loading {path} instead of the damaged newer checkpoint(s): "
                        f"{lost} iteration{'s' if lost != 1 else ''} lost ({iterations[-1]} -> {iteration})"
                    )
                self._print(loaded)
                return 0 if args.finetune else iteration  # --finetune: megatron's iteration 0
            line = f"damaged checkpoint {path}: {damage}"
            if ckpt_options(args).no_ckpt_fallback or args.ckpt_step is not None:
                why = "--no-ckpt-fallback" if args.no_ckpt_fallback else f"--ckpt-step={args.ckpt_step}"
                raise DamagedCheckpoint(f"{line} ({why}: not loading an older one)")
            self._print(line)
        raise DamagedCheckpoint(f"--load={args.load}: every checkpoint is damaged ({iterations})")

    def nested(self, args) -> "Checkpointer":
        """A checkpointer of this run's model for another directory, model weights only (a base)."""
        return Checkpointer(args, self.model, None, WeightsOnly())

    def _load_pretrained(self) -> int:
        """megatron's --pretrained-checkpoint (checkpoint/checkpointer.py load_checkpoint): with no
        checkpoint under --load, the run fine-tunes from it (its model weights, iteration 0)."""
        args = self.args
        if not args.pretrained_checkpoint:
            return 0
        base_args = copy.copy(args)
        base_args.load, base_args.finetune, base_args.save, base_args.pretrained_checkpoint = (
            args.pretrained_checkpoint, True, None, None)
        base_args.exit_on_missing_checkpoint = True
        self._print(f"no checkpoint under --load={args.load}: fine-tuning from --pretrained-checkpoint="
                    f"{args.pretrained_checkpoint}")
        base = self.nested(base_args)
        base._print = self._print
        base.load()
        return 0

    def _listing(self, first: ckpt_dirs.FirstRead | None) -> tuple[list[int], str | None]:
        """Rank 0 lists the committed checkpoints and reads the tracker (or takes what ``first``, the
        first read of --load, found of them); every rank gets its view."""
        view = [None]
        if self.rank == 0:
            view = [(first.iterations, first.tracker_note) if first is not None else ckpt_dirs.listing(self.args.load)]
        torch.distributed.broadcast_object_list(view, src=0)
        return view[0]

    def _load_verified(self, path: str, iteration: int,
                       first: ckpt_dirs.FirstRead | None = None) -> tuple[str | None, str | None]:
        """Load `path` with every file verified first: (the damage found, the same text on every
        rank, None) or (None, the line saying what was loaded). A checkpoint ``first`` (the first read
        of --load) looked at is not looked at again: the ranks agree on what each found there."""
        t0 = time.perf_counter()
        verifier = first.looked.get(iteration) if first is not None else None
        if verifier is None:
            verifier = integrity.Verifier(path)
            problems, verifiable = verifier.inspect()  # collective
        else:
            problems, verifiable = verifier.agree()  # collective
        if problems:
            return "; ".join(problems), None
        if not verifiable:
            self._print(f"note: {path} has no checksums (saved before they were recorded): it cannot be verified")
        try:
            common = first.common if first is not None and first.iteration == iteration else None
            with seams.verified_reads(verifier) if verifiable else contextlib.nullcontext():
                return None, self._load(path, iteration, t0, verifier, common)
        except BaseException:  # torch's CheckpointException (wrapping ours) is a BaseException
            if not verifier.problems:  # set on every rank when the ranks agreed on damage
                raise
            return "; ".join(verifier.problems), None

    def _load(self, path: str, iteration: int, t0: float, verifier, common: dict | None = None) -> str:
        """``common``: the checkpoint's common state where the first read of --load read it already."""
        args = self.args
        found = (verifier.config or {}).get("sharded_backend")  # the format it was written in
        if args.auto_detect_ckpt_format and found != args.ckpt_format:  # megatron's: the format on disk decides
            raise ConfigError(
                f"--auto-detect-ckpt-format: {path} is a {found} checkpoint; this run's model loads "
                f"{args.ckpt_format} (a Megatron-FSDP model fsdp_dtensor, a DDP or torch FSDP2 model torch_dist)"
            )
        if args.ckpt_format == "fsdp_dtensor":
            if ckpt_lora.save_part(args):
                raise ConfigError(f"--load={args.load}: {path} is a Megatron-FSDP (fsdp_dtensor) checkpoint; a LoRA "
                                  "base loads from torch_dist (an import, a DDP run) before the model is sharded")
            common, self._pending_rng = fsdp_checkpoint.load(self, path, iteration, verifier)
            return self._loaded(path, iteration, t0, verifier, common, common["layout"] == ckpt_state.layout(args))
        if common is None:
            common = dist_checkpointing.load_common_state_dict(path)
        part = ckpt_lora.plan(self, path, iteration, common)  # LoRA: an adapter checkpoint loads its base first
        if common.get("scheduler") is None and not args.finetune:  # an import (megatron_ext/hf): weights only
            raise ConfigError(f"--load={args.load}: {path} holds model weights only (an imported model): "
                              "load it with --finetune")
        same_layout = common["layout"] == ckpt_state.layout(args)
        # --finetune: the model weights only, as megatron's load_checkpoint (fresh optimizer, schedule, RNG)
        with_rng = same_layout and not args.no_load_rng and not args.finetune and common.get("has_rng", False)
        with_optimizer = self._optimizer_to_load(path, "optimizer" in common)
        template = sharded_state_dict(
            args, self.model, self.optimizer, self.scheduler, iteration,
            loading=True, with_optimizer=with_optimizer, with_rng=with_rng, part=part,
        )
        onto_checkpoint_names(args, template, len(self.model), path, with_optimizer)
        strategy = get_default_load_sharded_strategy(path)
        if args.ckpt_fully_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        with seams.common_state_given(path, common):  # read above: megatron-core's load does not read it again
            state = dist_checkpointing.load(template, path, strategy, strict=args.dist_ckpt_strictness)
        with torch.no_grad():  # distrib_optimizer.py:1225 copies into views of grad-tracked params
            # torch FSDP2: the load wrote the DTensors' local shards in place; megatron skips both
            # load_state_dicts (training.py:2204, skip_load_to_model_and_opt)
            for i, chunk in enumerate(self.model if not args.use_torch_fsdp2 else []):
                module = unwrap(chunk)
                load_model_state(module, te_names.with_own_extra_states(module, state[model_key(i)]), part)
            if args.check_for_nan_in_loss_and_grad:  # the non-finite check, before the first step
                bad = non_finite_parameters(self.model)
                if bad:
                    more = ", ..." if len(bad) > 3 else ""
                    verifier.problems = [f"non-finite values in {len(bad)} parameters ({', '.join(bad[:3])}{more})"]
                    raise integrity.Damaged(verifier.problems)
            if with_optimizer and args.use_torch_fsdp2:
                seams.restore_fsdp2_optimizer_step(self.optimizer, state["optimizer"])
            elif with_optimizer:
                self.optimizer.load_state_dict(state["optimizer"])
                seams.restore_optimizer_step(self.optimizer, state["optimizer"])
        if not args.finetune:
            self.scheduler.load_state_dict(state["scheduler"])
        self._pending_rng = state["rng_state"] if with_rng else None
        return self._loaded(path, iteration, t0, verifier, common, same_layout)

    def _loaded(self, path: str, iteration: int, t0: float, verifier, common: dict, same_layout: bool) -> str:
        args = self.args
        if not same_layout:
            self._print(
                f"checkpoint layout {common['layout']} differs from this run's {ckpt_state.layout(args)}: "
                "resharded by dist_checkpointing; RNG state not restored"
            )
        torch.distributed.barrier()
        self.last_saved = iteration if os.path.abspath(args.load) == os.path.abspath(args.save or "") else None
        self.loaded = {"iteration": iteration, "load_s": time.perf_counter() - t0, "verify_s": verifier.seconds,
                       "agree_s": verifier.agree_seconds, "verified_files": len(verifier.verified),
                       "verified_bytes": verifier.bytes_read}
        verified = (f"; verified {len(verifier.verified)} files in {verifier.seconds:.2f} s"
                    if verifier.files is not None else "")
        return (
            f"resuming from checkpoint {path} at iteration {iteration} "
            f"(consumed samples {common['consumed_samples']}; loaded in {time.perf_counter() - t0:.2f} s{verified})"
        )

    def _optimizer_to_load(self, path: str, saved: bool) -> bool:
        """Whether the load reads the optimizer state: a run that trains, resuming (not --finetune, not
        --no-load-optim), from a checkpoint that ``saved`` it. One saved without it (--no-save-optim,
        or --freeze-all-layers, where nothing trained) starts its optimizer fresh, which the user sees."""
        args = self.args
        wanted = not args.no_load_optim and ckpt_state.optimizer_has_state(args) and not args.finetune
        if wanted and not saved:
            self._print(f"note: {path} holds no optimizer state (saved with --no-save-optim or "
                        "--freeze-all-layers): the optimizer starts fresh")
        return wanted and saved

    def restore_rng(self) -> None:
        """Put back the loaded checkpoint's RNG states. Call after building the data iterators:
        creating a DataLoader iterator draws its base seed from the CPU generator."""
        if self._pending_rng is not None:
            ckpt_state.set_rng_state(self._pending_rng)
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
        keep = ckpt_dirs.retained(iterations, ckpt_options(args).save_keep_last, args.save_retain_interval)
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

    def _print(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)


