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

import copy
import os

import torch

from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import integrity, resuming
from megatron_ext.checkpoint.resuming import Resuming
from megatron_ext.checkpoint.saving import Saving
from megatron_ext.errors import ConfigError


# ---------------------------------------------------------------------------------------------
# --finetune from torch_dist into a Megatron-FSDP model
# ---------------------------------------------------------------------------------------------
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
    lines = resuming.LOADED_BEFORE_SHARDING.setdefault(id(args), [])
    ckpt._print = lines.append
    ckpt.load()
    lines.append("the torch_dist weights were loaded before Megatron-FSDP sharded the model")


# ---------------------------------------------------------------------------------------------
# the checkpointer the loop uses
# ---------------------------------------------------------------------------------------------
class Checkpointer(Resuming, Saving):
    """``start = ckpt.load()`` before the loop, ``ckpt.restore_rng()`` once the data iterators
    exist; ``ckpt.after_step(i)`` after each iteration;
    ``ckpt.close(i)`` at exit (saves if the last iteration is not saved yet, waits for async).
    Its resume: resuming.py; its save: saving.py."""

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

    def nested(self, args) -> "Checkpointer":
        """A checkpointer of this run's model for another directory, model weights only (a base)."""
        return Checkpointer(args, self.model, None, WeightsOnly())

    def _print(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)
