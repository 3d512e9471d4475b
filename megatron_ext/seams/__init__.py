"""Every place megatron_ext replaces, wraps or reaches into a megatron-core internal: one module per
capability, each entry naming the upstream site (file:line in megatron-core 0.19.2).

    training.py        process-wide megatron state cleared between runs; torch norms under
                       sequence parallelism
    architectures.py   what real configs need of the local spec: multi-latent attention's core
                       attention, the zero-centred norm of --apply-layernorm-1p
    schedules.py       TP (and EP) collectives routed through the overlap lanes, per-lane scratch
                       buffers; the plain schedule's passes labelled (benchmark only) or replaced
                       by stand-ins (recording its pipeline messages, tests only)
    offload.py         the modules activation offload hooks (nothing replaced)
    moe.py             the token dispatcher swapped per MoE layer; the sync audit's CUDA emulation;
                       one-rank reductions that let biased experts add their bias in place
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
    megatron_training.py  GPT2BPETokenizer/BertWordPiece from local files without a hub look-up;
                       megatron.training's global args/timers/writer set for the length of a run

Every replacement of a megatron (or torch) attribute is a reversible record in SEAMS (the record
type of the CPU shims, megatron_ext/patching.py). A run installs the records its flags need once,
before its model is built (install(args), from training/model.py build_model), and its teardown
removes what it installed (uninstall()). Scoped records (a benchmark's labels, the sync detector's
emulation) are applied only inside a block (`Patch.applied()`); the torch-norm record is held for
the process (by the CPU shim registry, or by the model builder on CUDA). CPU-only compatibility
shims are not here: megatron_ext/platform/cpu_shims.py.
"""
from __future__ import annotations

from typing import Dict, List

from megatron_ext.patching import Patch
from megatron_ext.seams import (
    architectures, checkpointing, fsdp, fsdp2, fsdp_fetch, moe, offload, planner, schedules, sharded_params,
    te_spec, training,
)
from megatron_ext.seams.checkpointing import (
    checksummed_writes, ensure_optimizer_state, restore_fsdp2_optimizer_step, restore_optimizer_step,
    set_write_results_queue, verified_reads,
)
from megatron_ext.seams.fsdp import complete_fsdp_optimizer_state, wait_for_prefetched_gathers
from megatron_ext.seams.moe import replace_token_dispatcher, reset_moe_aux_loss_scale, run_experts_grouped
from megatron_ext.seams.offload import offload_fused_experts, offload_layers, offload_targets, offload_unwrap
from megatron_ext.seams.schedules import label_plain_schedule_passes
from megatron_ext.seams.training import TORCH_NORM_SEQUENCE_PARALLEL, reset_megatron_globals
from megatron_ext.seams.megatron_training import install_tokenizer_seams, megatron_training_globals  # noqa: F401

_CAPABILITIES = (
    training, architectures, schedules, offload, moe, checkpointing, sharded_params, fsdp, fsdp2, fsdp_fetch,
    planner, te_spec,
)
SEAMS: Dict[str, Patch] = {s.name: s for module in _CAPABILITIES for s in getattr(module, "SEAMS", ())}
_RUN: List[Patch] = []  # applied for the current run, in order; uninstall() removes them


def apply_for_run(*records: Patch) -> None:
    """Apply records until the run's teardown (idempotent)."""
    for record in records:
        if not record.active:
            record.apply()
            _RUN.append(record)


def install(args) -> None:
    """The seams this run's flags need."""
    for module in _CAPABILITIES:
        apply_for_run(*getattr(module, "for_run", lambda _args: ())(args))


def uninstall() -> None:
    """Back to megatron-core's own code for everything the run installed."""
    while _RUN:
        _RUN.pop().remove()


def without(name: str):
    """One seam removed inside the block (side-by-side measurements, tests)."""
    return SEAMS[name].without()


def install_schedules_seams() -> None:
    """The overlap's seams without its flag: a benchmark or test that records the plain schedule's
    collectives too (pass-through unless megatron_ext.schedules.lanes is active)."""
    apply_for_run(*schedules.RUN)


def install_sharded_params_seams(model=None) -> None:
    """`model`: DDP chunks built before the install, whose forward pre-hooks are made again."""
    apply_for_run(*sharded_params.SEAMS)
    sharded_params.reregister_forward_pre_hooks(model)


def remove_sharded_params_seams(model=None) -> None:
    """Back to megatron-core's own code (for side-by-side measurements)."""
    for record in reversed(sharded_params.SEAMS):
        record.remove()
    sharded_params.reregister_forward_pre_hooks(model)


def sharded_params_seams_installed() -> bool:
    return all(record.active for record in sharded_params.SEAMS)


__all__ = [
    "SEAMS", "TORCH_NORM_SEQUENCE_PARALLEL", "apply_for_run", "install", "uninstall", "without",
    "ensure_optimizer_state", "restore_optimizer_step", "set_write_results_queue", "checksummed_writes",
    "verified_reads", "complete_fsdp_optimizer_state", "wait_for_prefetched_gathers", "replace_token_dispatcher",
    "reset_moe_aux_loss_scale", "run_experts_grouped", "offload_fused_experts", "offload_layers", "offload_targets", "offload_unwrap",
    "install_schedules_seams", "label_plain_schedule_passes", "install_sharded_params_seams",
    "remove_sharded_params_seams", "sharded_params_seams_installed", "reset_megatron_globals",
]
