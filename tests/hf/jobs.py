"""Job functions of the Hugging Face tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import arguments


def import_export(hf_dir: str, ckpt: str, out: str, max_shard_bytes: int = 40 * 2**10) -> dict:
    """One rank: import, export; the shard names and the peak RSS."""
    import resource

    from megatron_ext import hf

    hf.import_hf(hf_dir, ckpt, parse=arguments.parse)
    names, _ = hf.export_hf(ckpt, out, max_shard_bytes=max_shard_bytes, parse=arguments.parse)
    return {"shards": names, "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def export(load: str, out: str, recipe: str) -> list:
    from megatron_ext import hf

    return hf.export_hf(load, out, recipe=recipe, max_shard_bytes=40 * 2**10, parse=arguments.parse)[0]


def logits(load: str, ids: list, flags: list, recipe: str | None = None):
    from megatron_ext import hf

    out = hf.logits(load, ids, recipe=recipe, extra=flags, parse=arguments.parse)
    return None if out is None else out.numpy()  # a tensor would go through shared memory (a sharer thread)


def train(argv: list) -> list:
    import train as entry

    from megatron_ext import offload

    try:
        return entry.main(list(argv))
    finally:
        offload.detach()


def finetune_under_ddp_and_fsdp(argv: list, fsdp: list) -> dict:
    """The same fine-tune from an import under DDP + the distributed optimizer and under
    Megatron-FSDP (`fsdp`): each iteration's loss and grad norm, and what the checkpointer printed."""
    import contextlib
    import io

    import train as entry

    out = {}
    for name, flags in (("ddp", ["--use-distributed-optimizer"]), ("fsdp", fsdp)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = entry.main([*argv, *flags])
        out[name] = [(h["lm loss"], h["grad norm"]) for h in history]
        out[name + " printed"] = [line for line in printed.getvalue().splitlines() if line.startswith("[checkpoint]")]
    return out
