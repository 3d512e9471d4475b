"""Resuming: the Checkpointer's load (checkpointer.py, which mixes this class in and sets the state it
reads): the newest intact checkpoint under --load (or --ckpt-step, or --pretrained-checkpoint), every
file verified before it is used (integrity.py), a damaged one named in one line and the next older
intact one loaded, the model, optimizer, scheduler and RNG states put back."""
from __future__ import annotations

import contextlib
import copy
import os
import time

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

from megatron_ext import seams
from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import fsdp as fsdp_checkpoint
from megatron_ext.checkpoint import integrity
from megatron_ext.checkpoint import lora as ckpt_lora
from megatron_ext.checkpoint import state as ckpt_state
from megatron_ext.checkpoint import te_names
from megatron_ext.checkpoint.model_state import (
    load_model_state,
    model_key,
    non_finite_parameters,
    onto_checkpoint_names,
    sharded_state_dict,
    unwrap,
)
from megatron_ext.checkpoint.options import CheckpointOptions
from megatron_ext.errors import ConfigError


class DamagedCheckpoint(ConfigError):
    """The checkpoint to resume from failed verification and no older one is to be loaded
    (--no-ckpt-fallback, --ckpt-step, or none intact): one line naming the checkpoint and files,
    raised on every rank before any compute, like a refused flag."""


# --finetune from torch_dist into a Megatron-FSDP model: what checkpointer.py load_before_sharding
# loaded ahead of the wrap, printed by the loop's load
LOADED_BEFORE_SHARDING: dict[int, list] = {}  # id(args) -> the lines the loop's load prints


class Resuming:
    """The Checkpointer's resume: ``load()`` before the loop, ``restore_rng()`` once the data
    iterators exist."""

    def load(self) -> int:
        """Load the newest intact checkpoint (or --ckpt-step) under --load; return its iteration,
        0 if there is none. Every file is verified before it is used (integrity.py); a damaged
        checkpoint is named in one line and the next older intact one loads instead, unless
        --no-ckpt-fallback (or --ckpt-step) asks for exactly that one."""
        args = self.args
        if not args.load:
            return self._load_pretrained()
        preloaded = LOADED_BEFORE_SHARDING.pop(id(args), None)
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
            if CheckpointOptions.from_args(args).no_ckpt_fallback or args.ckpt_step is not None:
                why = "--no-ckpt-fallback" if args.no_ckpt_fallback else f"--ckpt-step={args.ckpt_step}"
                raise DamagedCheckpoint(f"{line} ({why}: not loading an older one)")
            self._print(line)
        raise DamagedCheckpoint(f"--load={args.load}: every checkpoint is damaged ({iterations})")

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
