"""torch FSDP2 jobs: the same run under DDP + distributed optimizer and under --use-torch-fsdp2, in one
job, so a comparison costs one pool round trip; and its torch_dist checkpoints resumed."""
from __future__ import annotations

FSDP2 = ["--use-torch-fsdp2"]


def _losses(argv: list[str]) -> list[dict]:
    from tests.training.jobs_fsdp import _losses as losses

    return losses(argv)


def against_ddp(argv: list[str], features: dict | None = None) -> dict:
    """{'ddp': history, 'fsdp2': history, name: history of FSDP2 with that feature's flags, ...}: all
    from the same weights and batches."""
    out = {"ddp": _losses(argv + ["--use-distributed-optimizer"]), "fsdp2": _losses(argv + FSDP2)}
    for name, flags in (features or {}).items():
        out[name] = _losses(argv + FSDP2 + flags)
    return out


def resume(argv: list[str], save_dir: str) -> dict:
    """jobs_fsdp.resume on an FSDP2 run (straight, saved at 2 and 3 and resumed, the newest damaged
    and refused or fallen back from); then what the checkpoint holds: the backend megatron-core
    recorded, and how many bytes of each model tensor each rank's file holds (FSDP2 shards every
    parameter over the data-parallel ranks; each rank writes its DTensors' local shards); a DDP run
    resumed from it; a bf16 run saved and resumed."""
    import json
    import os
    import pickle

    import torch

    from tests.training.jobs_fsdp import RESUME_ITERS, resume as resume_job

    out = resume_job(argv + FSDP2, save_dir)
    ckpt = os.path.join(save_dir, "iter_0000002")
    with open(os.path.join(ckpt, "metadata.json")) as f:
        out["backend"] = json.load(f)["sharded_backend"]
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    written = {}  # model key -> {file: bytes}
    for index, item in metadata.storage_data.items():
        if not index.fqn.startswith("optimizer.") and "/shard_" not in index.fqn:  # tensors, not objects
            per_file = written.setdefault(index.fqn, {})
            per_file[item.relative_path] = per_file.get(item.relative_path, 0) + item.length
    out["written"] = written
    # the same format as a DDP run's (global keys and offsets): DDP resumes the FSDP2 checkpoint
    out["ddp_resumed"] = _losses(argv + ["--train-iters", str(RESUME_ITERS), "--load", save_dir,
                                         "--ckpt-step", "2"])
    # bf16: megatron's mixed-precision optimizer (fp32 main params beside the optimizer state)
    bf16 = argv + FSDP2 + ["--bf16", "--train-iters", "4"]
    out["bf16_straight"] = _losses(bf16 + ["--save", save_dir + "_bf16", "--save-interval", "2"])
    out["bf16_resumed"] = _losses(bf16 + ["--load", save_dir + "_bf16", "--ckpt-step", "2"])
    torch.distributed.barrier()
    return out
