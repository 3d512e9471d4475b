"""LoRA vs full fine-tuning on the same model and layout: tokens/s, peak memory, gradient and optimizer
bytes per rank, measured side by side in one launch.

    .venv/bin/python scripts/bench_lora.py [--recipe recipes/tiny_dense.yaml] [--nproc 2] [--rank 8]
        [--targets all-linear] [--rounds 2] [--iters 8] [--extra "--tensor-model-parallel-size 2"] [--json]
    .venv/bin/python scripts/bench_lora.py --smoke     # one round of 3 iterations per mode: seconds

Both modes train the same recipe (mock data, --layout-invariant-init) under the same flags; LoRA adds
``--lora-rank R --lora-alpha 2R [--lora-target-modules ...]``. The timed runs alternate (full, LoRA,
full, LoRA, ...); tokens/s is the median over the iterations after the first two of every round, on
the slowest rank; the bytes are the log line's, per rank (the largest); the peak is the most bytes the
run itself allocated (model, optimizer state, activations), from a separate shorter run
(scripts/bench/lora.py). On this 2-core CPU the timings are noisy (other processes share it).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import fixed_width  # noqa: E402
from bench.lora import measure, summarize  # noqa: E402
from megatron_ext.measure.launch import run_world  # noqa: E402


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, NCCL"
    return f"cpu ({os.cpu_count()} cores), gloo: not measured on GPU"


def run(recipe: str, nproc: int, rank: int, targets: list[str], rounds: int, iters: int, extra: list[str]) -> dict:
    argv = ["--recipe", recipe, "--mock-data", "--layout-invariant-init", "--lr-warmup-iters", "0",
            "--world-size", str(nproc), *extra]
    lora = ["--lora-rank", str(rank), "--lora-alpha", str(2 * rank)]
    if targets:
        lora += ["--lora-target-modules", *targets]
    modes = {"full": [], "lora": lora}
    per_rank = run_world(nproc, measure, timeout=1800, argv=argv, modes=modes, rounds=rounds, iters=iters, warmup=2,
                         memory_iters=2)
    rows = summarize(per_rank)
    full, low = rows["full"], rows["lora"]
    ratios = {k: low[k] / full[k] for k in full if k != "timed_iterations" and full[k]}
    return {"device": device(), "world_size": nproc, "recipe": recipe, "flags": argv, "lora_flags": lora,
            "modes": rows, "lora_over_full": ratios}


def table(out: dict) -> str:
    cols = [("mode", 5), ("tokens/s", 9), ("peak MiB", 9), ("params MiB", 10), ("grads MiB", 9), ("optim MiB", 9)]
    rows = []
    for mode, r in list(out["modes"].items()) + [("ratio", out["lora_over_full"])]:
        mib = [r.get(k, 0) / (1 if mode == "ratio" else 2**20)
               for k in ("peak_bytes_per_rank", "param_bytes_per_rank", "grad_bytes_per_rank", "optim_bytes_per_rank")]
        fmt = "{:.3f}" if mode == "ratio" else "{:.2f}"
        rate = ("{:.3f}" if mode == "ratio" else "{:.0f}").format(r["tokens_per_s"])
        rows.append([mode, rate, *map(fmt.format, mib)])
    lines = fixed_width(cols, rows)
    lines.append(f"{out['recipe']} on {out['world_size']} processes {' '.join(out['flags'][2:])}; LoRA: "
                 f"{' '.join(out['lora_flags'])}; ratio = LoRA / full; device: {out['device']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="recipes/tiny_dense.yaml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", nargs="*", default=[], help="--lora-target-modules (default: LoRA's default)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--extra", default="", help="more flags for both modes, one string")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="one round of 3 iterations per mode (seconds)")
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.iters = 1, 3
    out = run(a.recipe, a.nproc, a.rank, a.targets, a.rounds, a.iters, shlex.split(a.extra))  # workers log to stderr
    print(json.dumps(out) if a.json else table(out))


if __name__ == "__main__":
    main()
