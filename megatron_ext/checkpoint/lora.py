"""LoRA checkpoints (megatron_ext/lora/): what a LoRA run saves and how it loads.

Saved (torch_dist, the Checkpointer's directories, checksums and atomic commit): the adapter factors
(``...lora.<part>.lora_A.weight`` / ``lora_B.weight``) and the state training changes beside them (the
routers' ``expert_bias`` / ``qb_beta``, which megatron updates from routed token counts, not from
gradients), their optimizer state, the LR schedule, the RNG states; no base weight. The common state
records ``lora``: the adapters' configuration and ``base``, the checkpoint they apply to (its root
directory, iteration and the CRC-32 of its checksum manifest), or, for a base that no checkpoint
held, the seed that drew it.

Loaded by the Checkpointer (resuming.py ``_load``), as ``plan`` decides:

* a full checkpoint with LoRA on is the frozen base: its model weights only (with --finetune, or as
  --pretrained-checkpoint); the adapters start fresh (A drawn from its key, B zeros);
* an adapter checkpoint: first its base (--pretrained-checkpoint if given, else the recorded
  directory at the recorded iteration; its identity must be the recorded one), then the adapters,
  their optimizer state, schedule and RNG (resume), or the adapters only (--finetune);
* an adapter checkpoint without LoRA on is refused, naming the flags it needs.
"""
from __future__ import annotations

import copy
import os

from megatron_ext import lora, seams
from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import integrity as ckpt_integrity
from megatron_ext.errors import ConfigError
from megatron_ext.lora.adapters import is_adapter_key

ADAPTERS, BASE = "adapters", "base"
TRAINED_BUFFERS = ("router.expert_bias", "router.qb_beta")
_CONFIG_KEYS = ("rank", "alpha", "rslora", "fused", "targets")


def _trained(key: str) -> bool:
    return is_adapter_key(key) or key.endswith(TRAINED_BUFFERS)


def select(entries: dict, part: str | None) -> dict:
    """A model chunk's checkpoint entries of ``part`` (ADAPTERS: the adapters and the trained
    buffers; BASE: everything but the adapter factors, so a base's trained buffers, an imported
    DeepSeek-V3's score-correction bias, are where the run starts: an adapter checkpoint loaded
    after its base replaces them); all of them for None."""
    if part is None:
        return entries
    if part == ADAPTERS:
        return {k: v for k, v in entries.items() if _trained(getattr(v, "key", k))}
    return {k: v for k, v in entries.items() if not is_adapter_key(getattr(v, "key", k))}


def save_part(args) -> str | None:
    return ADAPTERS if lora.enabled(args) else None


def record(args, model: list) -> dict:
    """The common state's ``lora`` entry of a save."""
    base = getattr(seams.unwrapped(model[0]), "lora_base", None) or {
        "path": None, "seed": args.seed, "layout_invariant_init": bool(args.layout_invariant_init)}
    return {"rank": args.lora_rank, "alpha": args.lora_alpha if args.lora_alpha is not None else float(args.lora_rank),
            "rslora": bool(args.lora_rslora), "fused": args.lora_fused_adapters,
            "targets": lora.target_list(args), "dropout": args.lora_dropout, "scale": lora.scale(args), "base": base}


def identity(directory: str) -> str | None:
    """The CRC-32 of a checkpoint's checksum manifest (None if it records none)."""
    config = ckpt_integrity.read_config(directory)[0] or {}
    return (config.get(ckpt_integrity.KEY) or {}).get("crc32")


def flags(saved: dict) -> str:
    """The LoRA flags that rebuild the adapters of a checkpoint's record."""
    out = (f"--lora-rank {saved['rank']} --lora-alpha {saved['alpha']:g} "
           f"--lora-target-modules {' '.join(saved['targets'])}")
    fused = saved["fused"]
    return out + (" --lora-rslora" if saved["rslora"] else "") + (
        "" if fused is None else " --lora-fused-adapters" + "".join(f" {n}" for n in fused))


def plan(ckpt, path: str, iteration: int, common: dict) -> str | None:
    """What loading ``path`` means for this run (ADAPTERS, BASE or None when LoRA plays no part).
    For ADAPTERS the base is loaded here first."""
    args = ckpt.args
    saved = common.get("lora")
    if not lora.enabled(args):
        if saved is not None:
            raise ConfigError(f"--load={args.load}: {path} holds LoRA adapters only; load it with the flags it was "
                              f"trained with ({flags(saved)}) and its base")
        return None
    if saved is None:
        if not args.finetune:
            raise ConfigError(f"--load={args.load}: {path} is a full checkpoint; with {lora.FLAG} it is the frozen "
                              "base: load it with --finetune, or name it with --pretrained-checkpoint")
        root = os.path.abspath(os.path.dirname(path))
        seams.unwrapped(ckpt.model[0]).lora_base = {"path": root, "iteration": iteration, "checksum": identity(path)}
        return BASE
    mine = record(args, ckpt.model)
    differ = [k for k in _CONFIG_KEYS if mine[k] != saved[k]]
    if differ:
        raise ConfigError(f"--load={args.load}: {path} holds adapters of other flags ({flags(saved)}); this run has "
                          f"{flags(mine)}")
    _load_base(ckpt, saved["base"])
    return ADAPTERS


def _load_base(ckpt, recorded: dict) -> None:
    """The base an adapter checkpoint applies to, into the model: --pretrained-checkpoint if given
    (its newest checkpoint), else the recorded directory at the recorded iteration. Refused when its
    identity is not the recorded one."""
    args = ckpt.args
    root = args.pretrained_checkpoint or recorded.get("path")
    if root is None:
        drawn = {"seed": args.seed, "layout_invariant_init": bool(args.layout_invariant_init)}
        if {k: recorded.get(k) for k in drawn} != drawn:
            raise ConfigError(f"--load={args.load}: its adapters were trained on the base --seed="
                              f"{recorded.get('seed')} drew (--layout-invariant-init="
                              f"{recorded.get('layout_invariant_init')}), not on this run's; give those flags or the "
                              "base with --pretrained-checkpoint")
        return
    base_args = copy.copy(args)
    base_args.load, base_args.finetune, base_args.save, base_args.pretrained_checkpoint = root, True, None, None
    base_args.ckpt_step = recorded.get("iteration") if not args.pretrained_checkpoint else None
    base_args.exit_on_missing_checkpoint = True
    base = ckpt.nested(base_args)
    lines = []
    base._print = lines.append
    base.load()
    loaded = getattr(seams.unwrapped(ckpt.model[0]), "lora_base", None)
    if loaded is None:  # the directory held adapters, not a base
        raise ConfigError(f"--pretrained-checkpoint={root}: holds LoRA adapters, not a base model")
    if recorded.get("checksum") is not None and (loaded["iteration"], loaded["checksum"]) != (
            recorded.get("iteration"), recorded["checksum"]):
        raise ConfigError(
            f"--load={args.load}: its adapters were trained on {recorded['path']} iteration {recorded['iteration']} "
            f"(manifest CRC-32 {recorded['checksum']}); {root} iteration {loaded['iteration']} has "
            f"{loaded['checksum']}: another base")
    ckpt._print(f"base model from {ckpt_dirs.checkpoint_dir(loaded['path'], loaded['iteration'])} "
                f"(the adapters' base; manifest CRC-32 {loaded['checksum']})")
