"""Every place megatron_ext replaces, wraps or reaches into a megatron-core internal: one module per
capability, each entry naming the upstream site (file:line in megatron-core 0.19.2).

    training.py        process-wide megatron state cleared between runs; torch norms under
                       sequence parallelism; the model inside megatron-core's wrappers
    architectures.py   what real configs need of the local spec: multi-latent attention's core
                       attention, the zero-centred norm of --apply-layernorm-1p
    schedules.py       TP (and EP) collectives routed through the overlap lanes, per-lane scratch
                       buffers, megatron's combined-1F1B plan opening activation-offload groups;
                       the plain schedule's passes labelled (benchmark only) or replaced by
                       stand-ins (recording its pipeline messages, tests only)
    lora.py            LoRA: the targeted linears' forward and checkpoint entries, the router's gating
                       (per instance); the embedding's output needing a gradient under recompute
    moe.py             the token dispatcher swapped per MoE layer; the sync audit's CUDA emulation;
                       one-rank reductions that let biased experts add their bias in place;
                       what a pass keeps in megatron's MoE modules (the overlap swaps it per lane)
    planner.py         while the planner traces a tiny copy of the model: balanced MoE routing,
                       megatron's global buffer requests recorded
    te_spec.py         transformer-engine's layer spec built without transformer-engine (stand-ins
                       with megatron-core's own sharded_state_dict), for the dry-run's key check
    checkpointing.py   distributed-optimizer state around dist_checkpointing; the writer's queue;
                       checksums taken as files are written, files verified before they are read
    sharded_params.py  per-bucket, not per-parameter, host work in the DDP gather / reduce path
    fsdp.py            Megatron-FSDP: its unsharded buckets counted, its optimizer state completed for
                       checkpoints, its prefetched all-gathers waited for at teardown
    fsdp2.py           torch FSDP2: torch_dist checkpoints pair optimizer state with the DTensors'
                       local shards
    fsdp_fetch.py      Megatron-FSDP: parameter and gradient views of the unsharded buckets made
                       once, gradients handled per FSDP unit, not per parameter
    megatron_training.py  GPT2BPETokenizer/BertWordPiece from local files without a hub look-up (a
                       record applied while the tokenizer is built); megatron.training's global
                       args/timers/writer set for the length of a run

The modules above are what the capabilities use; registry.py composes them (the floors:
docs/architecture.md). Every replacement of a megatron (or torch) attribute is a reversible record in
registry.SEAMS (the record type of the CPU shims, megatron_ext/patching.py). A run installs the
records its flags need once, before its model is built (registry.install(args), from
training/model.py build_chunks), and its teardown removes what it installed (registry.uninstall()).
Where offload attaches (nothing replaced) lives with offload: megatron_ext/offload/targets.py. Scoped
records (a benchmark's labels, the sync detector's emulation, the tokenizer's local files) are
applied only inside a block (`Patch.applied()`); the torch-norm record is held for the process (by
the CPU shim registry, or by the model builder on CUDA). CPU-only compatibility shims are not here:
megatron_ext/platform/cpu_shims/.
"""
from __future__ import annotations

from megatron_ext.seams.checkpointing import (  # noqa: F401 (the package's API)
    checksummed_writes, common_state_given, ensure_optimizer_state, restore_fsdp2_optimizer_step,
    restore_optimizer_step, set_write_results_queue, verified_reads,
)
from megatron_ext.seams.fsdp import complete_fsdp_optimizer_state, wait_for_prefetched_gathers  # noqa: F401
from megatron_ext.seams.megatron_training import LOCAL_FILES_TOKENIZER, megatron_training_globals  # noqa: F401
from megatron_ext.seams.moe import replace_token_dispatcher, reset_moe_aux_loss_scale, run_experts_grouped  # noqa: F401
from megatron_ext.seams.training import TORCH_NORM_SEQUENCE_PARALLEL, reset_megatron_globals, unwrapped  # noqa: F401

__all__ = [
    "TORCH_NORM_SEQUENCE_PARALLEL", "ensure_optimizer_state", "restore_optimizer_step", "restore_fsdp2_optimizer_step",
    "set_write_results_queue", "checksummed_writes", "verified_reads", "common_state_given",
    "complete_fsdp_optimizer_state",
    "wait_for_prefetched_gathers", "replace_token_dispatcher", "reset_moe_aux_loss_scale", "run_experts_grouped",
    "reset_megatron_globals", "LOCAL_FILES_TOKENIZER", "megatron_training_globals", "unwrapped",
]
