"""Megatron-FSDP composed with megatron_ext's features: the same Megatron-FSDP run with and
without each feature, in one job (one model layout, one pool round trip), so a comparison is of
the feature alone (same sharding strategy, same layout, same weights and batches)."""
from __future__ import annotations

import hashlib

import arguments

FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


def _digest(t) -> str:
    import torch

    t = t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t
    # a copy: numpy over a parameter's own storage would pin it (FSDP resizes bucket storage)
    return hashlib.sha1(t.detach().clone().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _run(argv: list[str]) -> dict:
    """The training loop on this rank: its losses and grad norms, a hash of this rank's parameter
    shards after the last optimizer step (read before the run's teardown empties the wrapper), and
    what each feature says it did."""
    from megatron_ext import moe, offload
    from megatron_ext.schedules import overlap_1f1b
    from megatron_ext.training.run import Run

    finals = {}

    class Shards:  # the run's probe, after each step
        def after_step(self, run, iteration, result):
            # The optimizer's parameters: this rank's shards of the updated weights. (The modules'
            # unsharded views are not read: they may be a bucket freed, or being gathered, right now.)
            finals.clear()
            for i, group in enumerate(run.optimizer.param_groups):
                for j, p in enumerate(group["params"]):
                    finals[f"{i}.{j}"] = _digest(p)

    installed, calls = moe.installed, overlap_1f1b.STATS["calls"]
    try:
        with Run.from_argv(list(argv), probes=[Shards()], parse=arguments.parse) as run:
            history = run.train()
        manager = offload.current()
        stats = dict(manager.stats) if manager is not None else {}
    finally:
        offload.detach()
    return {
        "history": [(h["lm loss"], h["grad norm"]) for h in history],
        "params": finals,
        "offloaded": stats.get("offloaded_bytes", 0),
        "reloaded": stats.get("reloaded_bytes", 0),
        "dispatchers": moe.installed - installed,
        "overlap_calls": overlap_1f1b.STATS["calls"] - calls,
    }


def variants(argv: list[str], flags: dict) -> dict:
    """{name: run of argv + flags[name]} in the order given: one job, one model layout, so a
    comparison of wrappers (DDP against each sharding strategy) and of features under a wrapper
    shares its runs (each run's history, parameter shards and feature counts, as `_run`)."""
    from megatron_ext import seams

    out = {}
    for name, extra in flags.items():
        seams.reset_moe_aux_loss_scale()
        try:
            out[name] = _run(list(argv) + list(extra))
        finally:
            seams.reset_moe_aux_loss_scale()
    return out


def compose(argv: list[str], features: dict, ddp: dict | None = None, wrapper: list | None = None) -> dict:
    """{'off': run, name: run, ...}: the Megatron-FSDP run of `argv` (or that of `wrapper`'s flags),
    then the same run with each feature's flags added; and {'ddp ' + name: run} for each of `ddp`'s
    flags under megatron-core DDP + the distributed optimizer instead."""
    wrapper = FSDP if wrapper is None else list(wrapper)
    flags = {name: wrapper + list(extra) for name, extra in {"off": [], **features}.items()}
    flags.update({f"ddp {name}": ["--use-distributed-optimizer"] + list(extra) for name, extra in (ddp or {}).items()})
    return variants(argv, flags)
