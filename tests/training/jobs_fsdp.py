"""Megatron-FSDP jobs: the same run under DDP + distributed optimizer and under Megatron-FSDP, in one
job, so a comparison costs one pool round trip."""
from __future__ import annotations

FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


def _losses(argv: list[str]) -> list[dict]:
    import train as entry

    return [{"lm loss": r["lm loss"], "grad norm": r.get("grad norm")} for r in entry.main(argv)]


def against_ddp(argv: list[str], strategies: list[str]) -> dict:
    """{'ddp': history, strategy: history, ...}: the DDP + distributed-optimizer run, then one
    Megatron-FSDP run per sharding strategy, each from the same weights and batches."""
    out = {"ddp": _losses(argv + ["--use-distributed-optimizer"])}
    for strategy in strategies:
        out[strategy] = _losses(argv + FSDP + ["--data-parallel-sharding-strategy", strategy])
    return out
