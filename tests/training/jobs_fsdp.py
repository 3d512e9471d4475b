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


def resume(argv: list[str], save_dir: str) -> dict:
    """6 iterations straight; 3 (saved at 2 and 3), then resumed to 6 in a fresh model; then the
    newest checkpoint damaged in the middle of a tensor and the run resumed again, once with
    --no-ckpt-fallback (refused, naming the file) and once falling back to iteration 2."""
    import os

    import torch

    from megatron_ext.training.checkpointing import DamagedCheckpoint
    from tests.training.jobs_ckpt import _flip, _largest_tensor_item

    straight = _losses(argv + ["--train-iters", "6"])
    first = _losses(argv + ["--train-iters", "6", "--exit-interval", "3", "--save", save_dir, "--save-interval", "2"])
    resumed = _losses(argv + ["--train-iters", "6", "--load", save_dir])
    newest = os.path.join(save_dir, "iter_0000003")
    files = sorted(os.listdir(newest))
    if torch.distributed.get_rank() == 0:  # bytes in the middle of a tensor: only the checksum sees it
        offset, length = _largest_tensor_item(newest, "__1_0.distcp")
        _flip(os.path.join(newest, "__1_0.distcp"), offset + length // 2)
    torch.distributed.barrier()
    try:
        _losses(argv + ["--train-iters", "6", "--load", save_dir, "--no-ckpt-fallback"])
        refused = None
    except DamagedCheckpoint as e:
        refused = str(e)
    fallback = _losses(argv + ["--train-iters", "6", "--exit-interval", "3", "--load", save_dir])
    return {"straight": straight, "first": first, "resumed": resumed, "files": files, "refused": refused,
            "fallback": fallback}

