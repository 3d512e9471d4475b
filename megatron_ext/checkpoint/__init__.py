"""Checkpoints: save, resume, verify, describe. The one entry the run, the conversions and the planner use.

    checkpointer.py  the Checkpointer (save every --save-interval, resume from the newest intact one,
                     atomic commits, retention), the pre-shard --finetune load
    resuming.py      its load: the newest intact checkpoint, verified, with fallback
    saving.py        its save: written, checksummed, committed, retention applied
    model_state.py   what a checkpoint holds of the model and optimizer (sharded state dicts)
    options.py       the flags and their checks          reading.py   --load read ahead of a run
    dirs.py          the directories under --save/--load: iter_N, the tracker, debris, retention
    integrity.py     every file's CRC-32, recorded at commit and verified before a load uses it
    state.py         what a checkpoint holds beside the tensors: layout, RNG, the common state
    fsdp.py          Megatron-FSDP's fsdp_dtensor format (torch.distributed.checkpoint)
    lora.py          the LoRA record: base checkpoints under adapters, adapter-only saves
    recipe.py        the recipe a checkpoint records, and where its paths point after a move
    keys.py          --dry-run --load: the checkpoint's keys against the model's
    te_names.py      transformer-engine's and the local spec's names for one tensor
"""
import importlib

# name -> (module, its name there): resolved on first use, so that naming the package imports no
# megatron-core (the entry points set the platform up first; checkpointer.py imports megatron-core)
_PUBLIC = {
    "Checkpointer": ("checkpointer", "Checkpointer"),
    "DamagedCheckpoint": ("resuming", "DamagedCheckpoint"),
    "WeightsOnly": ("checkpointer", "WeightsOnly"),
    "add_arguments": ("options", "add_arguments"),
    "before_validate": ("options", "before_validate"),
    "validate": ("options", "validate"),
    "first_read": ("reading", "first_read"),
    "load_before_sharding": ("checkpointer", "load_before_sharding"),
    "FirstRead": ("dirs", "FirstRead"),
    "check_loadable": ("dirs", "check_loadable"),
    "committed_iterations": ("dirs", "committed_iterations"),
    "checkpoint_dir": ("dirs", "checkpoint_dir"),
    "handed": ("dirs", "handed"),
    "checkpoint_to_load": ("keys", "checkpoint_to_load"),
    "place": ("keys", "place"),
    "whole_model_args": ("keys", "whole_model_args"),
    "lora_flags": ("lora", "flags"),
    "describe_recipe": ("recipe", "describe"),
    "recorded_recipe": ("recipe", "recorded"),
    "relocate_recipe": ("recipe", "relocate"),
    "optimizer_has_state": ("state", "optimizer_has_state"),
    "CheckpointOptions": ("options", "CheckpointOptions"),
    "sharding_metadata": ("state", "sharding_metadata"),
    "sharded_tensors": ("state", "sharded_tensors"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value
    return value
