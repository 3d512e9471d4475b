"""Observability job functions, run on every rank of a persistent gloo world (see tests/dist.py)."""
from __future__ import annotations


def train_with_nan_loss(argv: list[str], nan_at: int) -> dict:
    """train.main(argv) with the loss of iteration `nan_at` replaced by NaN (on the ranks that hold
    it). Returns what was raised, the history, and how many host checks the detector made."""
    import torch

    import train as entry
    from megatron_ext.training import observability, step

    original_average, original_init = step._average_loss, observability.NonFiniteCheck.__init__
    calls, checkers = {"n": 0}, []

    def average(losses):
        calls["n"] += 1
        loss = original_average(losses)
        return loss * float("nan") if calls["n"] == nan_at else loss

    def init(self, args):
        original_init(self, args)
        checkers.append(self)

    step._average_loss, observability.NonFiniteCheck.__init__ = average, init
    error, history = None, None
    try:
        history = entry.main(argv)
    except observability.NonFiniteLoss as e:
        error = str(e)
    finally:
        step._average_loss, observability.NonFiniteCheck.__init__ = original_average, original_init
        from megatron_ext.training import parallel

        parallel.destroy()
    torch.distributed.barrier()
    return {"error": error, "history": history, "host_checks": checkers[0].host_checks}


def train(argv: list[str]) -> list[dict]:
    import train as entry

    return entry.main(argv)
