"""The seams a run installs: every reversible record of megatron_ext/seams/ in one registry
(SEAMS), the records a run's flags need installed before its model is built (install(args), from
training/model.py build_chunks) and removed by its teardown (uninstall()). It sits above the
capability packages: schedules.py's records bind megatron-core to the overlap's lanes, attention.py's
its core attention to the attention package's kernels (installed after architectures.py's, whose
multi-latent core attention it builds on)."""
from __future__ import annotations

from typing import Dict, List

from megatron_ext.patching import Patch
from megatron_ext.seams import (
    architectures, attention, checkpointing, fsdp, fsdp2, fsdp_fetch, lora, megatron_training, moe, planner,
    schedules, sft, sharded_params, te_spec, training,
)

_CAPABILITIES = (
    training, architectures, attention, schedules, moe, checkpointing, sharded_params, fsdp, fsdp2, fsdp_fetch,
    planner, sft, lora, te_spec, megatron_training,
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
