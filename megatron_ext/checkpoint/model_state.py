"""What a checkpoint holds of the model and its optimizer: each chunk's megatron-core sharded state dict
(a LoRA run's adapters or base alone: lora.py), the common and RNG state beside it (state.py), the
optimizer's; a load template's keys placed on the names a checkpoint of the other layer spec has
(te_names.py); the check a loaded model passes (no non-finite parameter)."""
from __future__ import annotations

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.utils import to_local_if_dtensor

from megatron_ext import seams
from megatron_ext.checkpoint import integrity
from megatron_ext.checkpoint import lora as ckpt_lora
from megatron_ext.checkpoint import state as ckpt_state
from megatron_ext.checkpoint import te_names
from megatron_ext.errors import ConfigError


def unwrap(chunk):
    """The model under megatron-core DDP: DDP.sharded_state_dict() keys carry a `module.` prefix
    that DDP.load_state_dict() does not accept, so both directions use the unwrapped module."""
    return chunk.module if hasattr(chunk, "no_sync") else chunk



def gather_params(model, optimizer) -> None:
    """With --overlap-param-gather the optimizer step updates only this rank's shard of each
    parameter; the other ranks' shards arrive in the next forward's pre-hooks. The model state
    saved now would hold the previous step's values there. A load writes the model weights and the
    distributed optimizer's (current) shard of them into the same memory, and the stale values are
    the ones that stayed (measured: a tiny_moe EP2 resume diverged at its first iteration). So
    gather first, as megatron.training's save_checkpoint_and_time does (training.py:3045,
    force_param_sync). The next forward gathers the same values again: training is unchanged."""
    from megatron.training.training import force_param_sync

    force_param_sync(model, optimizer=optimizer)



def non_finite_parameters(model) -> list[str]:
    """Names of the parameters holding NaN or Inf, over all ranks (collective; one host read per
    rank). Checksums cannot tell weights saved non-finite from good ones; megatron's own check
    would stop in the first backward pass with a traceback on every rank instead."""
    flags, names = [], []
    for i, chunk in enumerate(model):
        for name, p in unwrap(chunk).named_parameters():
            local = to_local_if_dtensor(p).reshape(-1)  # a DTensor (FSDP2): this rank's shard
            # a boolean copy of 2**20 elements at a time, not of the whole parameter: host allocators
            # kept what one per parameter left (measured: +92 MiB of an export's 175 MiB of weights)
            flags.append(torch.stack([torch.isfinite(part).all() for part in local.split(1 << 20)]).all())
            names.append(f"{model_key(i)}.{name}" if len(model) > 1 else name)
    bad = [n for n, ok in zip(names, torch.stack(flags).tolist() if flags else []) if not ok]
    return integrity.union_over_ranks(bad)



def model_key(i: int) -> str:
    return f"model{i}"



def load_model_state(module, state: dict, part: str | None) -> None:
    """load_state_dict; a LoRA part (ckpt_lora) holds some of the module's keys, and exactly those."""
    if part is None:
        module.load_state_dict(state, strict=True)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    expected = set(ckpt_lora.select(dict.fromkeys(missing), ckpt_lora.BASE if part == ckpt_lora.ADAPTERS
                                    else ckpt_lora.ADAPTERS))
    if unexpected or set(missing) != expected:
        raise ConfigError(f"LoRA {part} checkpoint: keys not in this model {sorted(unexpected)[:3]}, "
                          f"missing {sorted(set(missing) - expected)[:3]}")



def sharded_state_dict(args, model, optimizer, scheduler, iteration: int, *, loading: bool,
                       with_optimizer: bool, with_rng: bool, part: str | None = None) -> dict:
    """``part``: a LoRA run's adapters or base only (ckpt_lora.select); None: the whole model."""
    metadata = ckpt_state.sharding_metadata(args)
    state = ckpt_state.common_state(args, scheduler, iteration, with_rng=with_rng)
    for i, chunk in enumerate(model):
        state[model_key(i)] = ckpt_lora.select(unwrap(chunk).sharded_state_dict(metadata=metadata), part)
    if part == ckpt_lora.ADAPTERS:
        state["lora"] = ckpt_lora.record(args, model)
    if with_optimizer:
        if loading:
            seams.ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading, metadata=metadata)
    if with_rng:  # one object per rank (EP/TP ranks hold different tracker states)
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        state["rng_state"] = ShardedObject(
            "rng_state", ckpt_state.rng_state() if not loading else None, (world,), (rank,), replica_id=0
        )
    return state



def onto_checkpoint_names(args, template: dict, chunks: int, path: str, with_optimizer: bool) -> None:
    """The model's keys of a load template placed on the names the checkpoint has: the other layer
    spec's where they differ (a local-spec import into the transformer-engine spec and back,
    checkpoint/te_names.py), one line naming a key that has no place, the same on every rank
    (collective)."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    models = {key: template[key] for key in map(model_key, range(chunks))}
    parts = [None] * torch.distributed.get_world_size()  # every rank places its own part of the model
    torch.distributed.all_gather_object(parts, te_names.onto_checkpoint(models, load_sharded_metadata(path)))
    placement = te_names.Placement.over_ranks(parts)
    line = placement.refusal(args.load, te_names.spec_name(args), args.dist_ckpt_strictness, with_optimizer)
    if line:
        raise ConfigError(line)
