"""Long context: the longest sequence a fixed per-rank memory budget trains at CP 1, 2 and 4, with and
without activation offload, measured beside the planner's prediction of it.

    PYTHONPATH=. .venv/bin/python scripts/bench_long_context.py [--json] [--budget-mib N]
    PYTHONPATH=. .venv/bin/python scripts/bench_long_context.py --smoke [--json]   # two cases: seconds

Each (CP, offload) case trains tiny_dense with 8 layers (torch attention, one sequence a step) through
train.py's own path on a local world of CP ranks (gloo on CPU; ``scripts/bench/plan.measure``: a warm
step, then a measured one; peak bytes per rank from the project's tracker, ``max_memory_allocated`` on
CUDA) at two sequence lengths. With torch attention a rank's peak is linear in the sequence (no s x s
term), so the two points give its slope and the longest sequence under the budget, rounded down to a
multiple of 2 x CP. The planner's predicted peaks at the same two lengths give its longest sequence the
same way. The table goes to stderr; --json prints only JSON on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

MODEL = ["--recipe", "recipes/tiny_dense.yaml", "--num-layers", "8", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--lr-warmup-iters", "0", "--mock-data"]
OFFLOAD = ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj", "dense_mlp",
           "--activation-offload-min-tensor-kb", "1", "--activation-offload-chunk-mb", "0.0625"]
SEQS = (512, 1024)  # the two lengths each case is measured at
CPS = (1, 2, 4)
BUDGET_MIB = 48.0
SMOKE = dict(seqs=(64, 128), cases=((1, False), (2, True)), budget_mib=12.0)


def measure_case(cp: int, offload: bool, seqs) -> dict:
    """Measured and predicted peak bytes per rank (CP rank 0) at each of ``seqs``."""
    from bench.plan import measure
    from megatron_ext.measure.launch import run_world

    out = dict(cp=cp, offload=offload, seqs=list(seqs), measured=[], predicted=[])
    for seq in seqs:
        argv = [*MODEL, "--seq-length", str(seq), "--max-position-embeddings", str(seq),
                "--context-parallel-size", str(cp), *(OFFLOAD if offload else [])]
        (r,) = [r for r in run_world(cp, measure, argv=argv) if r["report"]]
        out["measured"].append(sum(r["measured"].values()))
        out["predicted"].append(r["predicted"]["peak_bytes"])
    return out


def slope(seqs, peaks) -> float:
    """Bytes per token of the line through the two (sequence, peak) points."""
    return (peaks[1] - peaks[0]) / (seqs[1] - seqs[0])


def longest(seqs, peaks, budget: float, cp: int) -> int:
    """The longest sequence under ``budget`` on the line through the two (sequence, peak) points,
    a multiple of 2 x CP (megatron's split of the sequence over CP); 0 when none fits."""
    per_token = slope(seqs, peaks)
    seq = seqs[0] + (budget - peaks[0]) / per_token if per_token > 0 else float("inf")
    step = 2 * cp
    return max(0, int(seq // step) * step)


def rows_for(cases: list, budget: float) -> list:
    rows = []
    for c in cases:
        meas, pred = longest(c["seqs"], c["measured"], budget, c["cp"]), longest(c["seqs"], c["predicted"], budget, c["cp"])
        rows.append(dict(c, longest_measured=meas, longest_predicted=pred,
                         error=(pred - meas) / meas if meas else None,
                         slope_bytes_per_token=slope(c["seqs"], c["measured"])))
    ref = next((r for r in rows if r["cp"] == 1 and not r["offload"]), None)
    if ref is not None:
        for r in rows:
            r["over_cp1_without_offload"] = r["longest_measured"] / ref["longest_measured"] if ref["longest_measured"] else None
            r["slope_over_cp1"] = r["slope_bytes_per_token"] / ref["slope_bytes_per_token"]
    return rows


def table(rows: list, budget: float) -> str:
    from megatron_ext.planner.cli import grid

    mib = 2**20
    head = ("CP", "offload", "peak MiB (meas / pred) at each length", "slope B/token", "x CP1's slope",
            "longest meas", "longest pred", "error", "x CP1 w/o offload")
    lines = [head]
    for r in rows:
        peaks = ", ".join(f"{s}: {m / mib:.2f} / {p / mib:.2f}" for s, m, p in zip(r["seqs"], r["measured"], r["predicted"]))
        lines.append((str(r["cp"]), "on" if r["offload"] else "off", peaks, f"{r['slope_bytes_per_token']:.0f}",
                      f"{r.get('slope_over_cp1', 0):.3f}", str(r["longest_measured"]), str(r["longest_predicted"]),
                      "-" if r["error"] is None else f"{100 * r['error']:+.1f}%",
                      "-" if r.get("over_cp1_without_offload") is None else f"{r['over_cp1_without_offload']:.2f}"))
    return f"per-rank budget {budget / mib:.1f} MiB\n" + grid(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--budget-mib", type=float, default=None, help=f"per-rank budget (default {BUDGET_MIB})")
    parser.add_argument("--smoke", action="store_true", help="seconds: CP 1 without offload and CP 2 with it, at "
                        f"lengths {SMOKE['seqs']}")
    opts = parser.parse_args(argv)
    seqs, budget_mib = (SMOKE["seqs"], SMOKE["budget_mib"]) if opts.smoke else (SEQS, BUDGET_MIB)
    budget = (opts.budget_mib or budget_mib) * 2**20
    runs = SMOKE["cases"] if opts.smoke else [(cp, offload) for cp in CPS for offload in (False, True)]
    os.environ.setdefault("MEGATRON_EXT_CUDA_FAITHFUL", "1")
    from megatron_ext import platform

    platform.setup()
    cases = []
    for cp, offload in runs:
        cases.append(measure_case(cp, offload, seqs))
        print(f"CP {cp} offload {'on' if offload else 'off'}: done", file=sys.stderr, flush=True)
    rows = rows_for(cases, budget)
    print(table(rows, budget), file=sys.stderr)
    if opts.json:
        print(json.dumps({"budget_bytes": budget, "device": platform.current().device.type, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
