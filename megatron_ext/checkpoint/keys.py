"""``--dry-run --load C``: every key of C's newest checkpoint placed in this run's model before any compute,
by its own name or the other layer spec's (checkpoint/te_names.py), on any machine. The run's whole model
(:func:`whole_model_args`) is built by the run's model-only bring-up on the meta device
(training/run.py ``check_load``), transformer-engine's spec with megatron_ext/seams/te_spec.py's
stand-ins where transformer-engine is not installed here (`--dry-run --platform cuda --assume-te` on a
CPU machine); this module finds the checkpoint and places its keys in that model's sharded state dict.
A key with no place is refused by name, as the load would refuse it."""
from __future__ import annotations

import os

from megatron_ext.checkpoint import te_names


def whole_model_args(args):
    """The run's arguments for its whole model: one pipeline stage, no tensor, expert or context
    parallelism (every global key and shape, as any layout writes them)."""
    import copy

    whole = copy.copy(args)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size"):
        setattr(whole, name, 1)
    whole.virtual_pipeline_model_parallel_size = None
    whole.sequence_parallel = False
    whole.decoder_first_pipeline_num_layers = whole.decoder_last_pipeline_num_layers = None
    whole.pipeline_model_parallel_layout = None
    whole.apply_rope_fusion = False  # a kernel, no parameter: megatron's config asks this machine for it
    return whole


def checkpoint_to_load(args):
    """(directory, dist_checkpointing's metadata of it) of the checkpoint the run would load: --ckpt-step's,
    else the newest whose structure and metadata read (the load falls back past damaged ones and names
    them; ckpt_dirs.check_loadable refuses a directory of damaged ones); None when there is none, or it is
    not torch_dist."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from megatron_ext.checkpoint import dirs as ckpt_dirs
    from megatron_ext.checkpoint import integrity as ckpt_integrity

    iterations = ckpt_dirs.committed_iterations(args.load) if os.path.isdir(args.load) else []
    if args.ckpt_step is not None:
        iterations = [i for i in iterations if i == args.ckpt_step]
    for iteration in reversed(iterations):
        path = ckpt_dirs.checkpoint_dir(args.load, iteration)
        if ckpt_integrity.structure_problems(path):
            continue
        if (ckpt_integrity.read_config(path)[0] or {}).get("sharded_backend") != "torch_dist":
            return None
        try:
            return path, load_sharded_metadata(path)
        except Exception:  # noqa: BLE001 - damaged metadata: the load names it and falls back
            continue
    return None


def _has_optimizer(metadata: dict) -> bool:
    return any(te_names.is_optimizer_key(k) for k in metadata)


def place(args, path: str, metadata: dict, model_state: dict) -> None:
    """--dry-run with --load: every key of the checkpoint the run loads (``checkpoint_to_load``: a torch_dist
    one, an import's or a DDP run's; Megatron-FSDP loads one before it shards the model) placed in the
    sharded state dict of this run's whole model, by its name or the other spec's; refused by name
    otherwise, as the load refuses. Records what was found on args (printed with the configuration)."""
    from megatron_ext.errors import ConfigError

    placement = te_names.onto_checkpoint(model_state, metadata)
    spec = te_names.spec_name(args)
    loads_optimizer = not (args.finetune or args.no_load_optim)  # as the load decides (and a checkpoint with one)
    line = placement.refusal(args.load, spec, args.dist_ckpt_strictness, loads_optimizer and _has_optimizer(metadata))
    if line:
        raise ConfigError(line)
    args.checkpoint_keys = f"{os.path.basename(path)}: {placement.describe(spec)}"
    args.config_sources["checkpoint_keys"] = "derived (--load's checkpoint placed in this run's model)"
