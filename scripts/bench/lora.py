"""LoRA vs full fine-tuning, measured side by side: the same model, layout and data through the training loop,
one run of each in turn (``rounds`` times, so both see the same machine), on every rank of a local
world (``megatron_ext.measure.launch.run_world``). Used by ``scripts/bench_lora.py``.

Per run: tokens/s of every iteration after the first ``warmup`` (the log line's), the log line's
per-rank parameter, gradient and optimizer-state bytes (megatron_ext/training/log_line.py
``state_bytes``), and in a separate shorter run the peak of the bytes the run itself allocated
(model, optimizer, activations): on CUDA the caching allocator's ``max_memory_allocated``
(``memtrack.CudaPeak``), on CPU the live-bytes tracker (``memtrack.LiveBytesTracker``), which
slows the run down, hence the separate run.
"""
from __future__ import annotations

import statistics

STATE_KEYS = ("param bytes", "grad bytes", "optim bytes")


def _train(argv: list[str]) -> list[dict]:
    from train import main

    return main(list(argv))


def _peak_bytes(argv: list[str]) -> int:
    import torch

    from megatron_ext.measure.memtrack import CudaPeak, LiveBytesTracker

    tracker = CudaPeak() if torch.cuda.is_available() else LiveBytesTracker()
    with tracker:
        _train(argv)
    return int(tracker.peak)


def measure(argv: list[str], modes: dict, rounds: int, iters: int, warmup: int, memory_iters: int) -> dict:
    """On every rank: {mode: {"tokens_per_s": [...], state bytes..., "peak_bytes": int}} for
    ``argv + modes[mode]``; the timed runs of the modes alternate, ``rounds`` times."""
    out = {mode: {"tokens_per_s": []} for mode in modes}
    timed = ["--train-iters", str(iters), "--log-interval", "1"]
    for _ in range(rounds):
        for mode, extra in modes.items():
            history = _train([*argv, *extra, *timed])
            out[mode]["tokens_per_s"] += [h["tokens/s"] for h in history[warmup:]]
            out[mode].update({k: history[-1][k] for k in STATE_KEYS})
    for mode, extra in modes.items():
        short = ["--train-iters", str(memory_iters), "--log-interval", "1"]
        out[mode]["peak_bytes"] = _peak_bytes([*argv, *extra, *short])
    return out


def summarize(per_rank: list[dict]) -> dict:
    """Per mode: the median tokens/s of the slowest rank's iterations (every rank logs the same global
    tokens), the state bytes and peak of the largest rank."""
    rows = {}
    for mode in per_rank[0]:
        rates = [statistics.median(r[mode]["tokens_per_s"]) for r in per_rank]
        rows[mode] = {"tokens_per_s": min(rates), "timed_iterations": len(per_rank[0][mode]["tokens_per_s"]),
                      **{k.replace(" ", "_") + "_per_rank": max(r[mode][k] for r in per_rank) for k in STATE_KEYS},
                      "peak_bytes_per_rank": max(r[mode]["peak_bytes"] for r in per_rank)}
    return rows
