"""Job of the trained-model export tests (every rank of a gloo world, tests/dist.py): train from a recipe,
export, take our logits."""
from __future__ import annotations

import arguments


def train_export_logits(argv: list, save: str, out: str, ids: list, layout: list, again: dict | None = None) -> dict:
    """train.py's main() on ``argv`` (its validation losses recorded as megatron's evaluate returns
    them), then scripts/convert.py export --load ``save`` --hf ``out`` on this world and our logits of
    ``ids`` under ``layout``; what rank 0 printed (stdout and stderr). ``again``: {"recipe", "out"}, a
    second export of the run under that recipe."""
    import contextlib
    import io

    from megatron.training import training as megatron_training

    import train as entry
    from megatron_ext import hf

    losses, original = [], megatron_training.evaluate

    def evaluate(*args, **kwargs):
        result = original(*args, **kwargs)
        losses.append({k: float(v) for k, v in result[0].items()})
        return result

    printed, errors = io.StringIO(), io.StringIO()
    megatron_training.evaluate = evaluate
    try:
        with contextlib.redirect_stdout(printed):
            history = entry.main(list(argv))
    finally:
        megatron_training.evaluate = original
    with contextlib.redirect_stderr(errors):
        names, iteration = hf.export_hf(save, out, parse=arguments.parse)
    again_errors = io.StringIO()
    if again:
        with contextlib.redirect_stderr(again_errors):
            hf.export_hf(save, again["out"], recipe=again["recipe"], parse=arguments.parse)
    ours = hf.logits(save, ids, extra=layout, parse=arguments.parse)
    return {"losses": [h["lm loss"] for h in history], "validation": losses, "printed": printed.getvalue(),
            "export stderr": errors.getvalue(), "again stderr": again_errors.getvalue(), "shards": names,
            "iteration": iteration, "logits": None if ours is None else ours.numpy()}
