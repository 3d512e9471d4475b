"""What checkpoint checksums cost: saves and loads of the tiny recipes with and without them.

    .venv/bin/python scripts/bench_ckpt.py [--saves 6] [--json]
    .venv/bin/python scripts/bench_ckpt.py --smoke [--json]    # tiny_dense, 3 saves and 1 load per case: seconds

Runs the training loop (megatron_ext/training/run.py) on a fresh 2-process gloo world per case (megatron_ext.measure.launch), DP2
with the distributed optimizer, saving every iteration, synchronously and with --async-save, with
checksums on (the default) and off. The first save of a run (planning, the first fork) is left out. Per save:

  save_ms     sync: the save call (write + commit); async: start of the save to its commit
  stall_ms    what the training loop waited in the save call (async: until the writer is forked)
  writer_ms   async: the forked writer process's run
  commit_ms   the commit (all ranks' files on disk): checksum list, rename, marker
  sum_ms      the checksums' own work on the slowest rank: summing in the writer (all but the
              file writes) plus the commit's share (picking up the sums, reading back `.metadata`,
              writing metadata.json)
  gather_ms   the commit's gather of the sums on rank 0 (mostly waiting for the slowest rank,
              which the commit's barrier waits for anyway)
  sum_%       sum_ms / save_ms (async: sum_ms / (writer_ms + commit_ms), the save's own work)
Then --loads loads (3) of the last checkpoint (medians): load_ms; verify_ms, the rank's own verification work (reading
and summing every file it reads; without checksums the completeness check); agree_ms, the
collectives in which the ranks decide together (mostly waiting for the slowest one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEVICE = "cpu (2 cores, shared), gloo, 2 processes: not measured on GPU"
RECIPES = {
    "tiny_dense": ["--recipe", "recipes/tiny_dense.yaml", "--use-distributed-optimizer"],
    "tiny_moe": ["--recipe", "recipes/tiny_moe.yaml", "--use-distributed-optimizer",
                 "--expert-model-parallel-size", "2"],
}


def measure(argv: list[str], save_dir: str, checksums: bool, loads: int = 3) -> dict:
    """Job (every rank): train with a save every iteration, then load the last checkpoint
    `loads` times."""
    import torch

    import arguments
    from megatron_ext.training.run import Run

    class Checksums:  # the run's probe: checksums on or off for its saves, its checkpointer kept
        def after_load(self, run):
            run.checkpointer.checksums = checksums
            made.append(run.checkpointer)

    made = []
    with Run.from_argv(argv + ["--save", save_dir, "--save-interval", "1", "--log-interval", "1000"],
                       probes=[Checksums()], parse=arguments.parse) as run:
        run.train()
    saves = made[-1].saves
    loaded = []
    for _ in range(loads):
        with Run.from_argv(argv + ["--load", save_dir], probes=[Checksums()], parse=arguments.parse) as run:
            run.train()
        loaded.append(made[-1].loaded)
    torch.distributed.barrier()
    return {"saves": saves, "loaded": loaded}


def run_case(recipe: str, saves: int, async_save: bool, checksums: bool, loads: int = 3) -> dict:
    from megatron_ext.measure.launch import run_world

    argv = RECIPES[recipe] + ["--train-iters", str(saves)] + (["--async-save"] if async_save else [])
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_world(2, measure, timeout=600, argv=argv, save_dir=tmp, checksums=checksums, loads=loads)
        size = sum(os.path.getsize(os.path.join(tmp, f"iter_{saves:07d}", f))
                   for f in os.listdir(os.path.join(tmp, f"iter_{saves:07d}")))
    rows = list(zip(*[r["saves"] for r in per_rank]))[1:]  # per save, every rank; the first left out

    def med(key, fn=max):
        values = [fn(s.get(key) or 0.0 for s in row) for row in rows]
        return 1e3 * statistics.median(values)

    out = {"recipe": recipe, "mode": "async" if async_save else "sync", "checksums": checksums,
           "bytes": size, "saves": len(rows), "save_ms": med("save_s"), "stall_ms": med("stall_s"),
           "commit_ms": 1e3 * statistics.median(max(s["save_s"] - s["commit_start_s"] for s in row) for row in rows)}
    if checksums:
        out["sum_ms"] = 1e3 * statistics.median(
            max((s["checksum_write_s"] or 0.0) + s["checksum_commit_s"] for s in row) for row in rows)
        out["gather_ms"] = med("gather_s")
    if async_save:
        out["writer_ms"] = med("writer_s") if checksums else None
    loads = list(zip(*[r["loaded"] for r in per_rank]))  # per load, every rank

    def med_load(key):
        return 1e3 * statistics.median(max(rank[key] for rank in load) for load in loads)

    out["load_ms"], out["verify_ms"], out["agree_ms"] = med_load("load_s"), med_load("verify_s"), med_load("agree_s")
    return out


def share(row: dict) -> float | None:
    if not row["checksums"]:
        return None
    if row["mode"] == "sync":
        return 100 * row["sum_ms"] / row["save_ms"]
    return 100 * row["sum_ms"] / (row["writer_ms"] + row["commit_ms"]) if row["writer_ms"] else None


def table(rows: list[dict]) -> str:
    from bench import fixed_width

    cols = [("recipe", 10), ("mode", 5), ("sums", 4), ("MB", 5), ("save_ms", 8), ("stall_ms", 8),
            ("writer_ms", 9), ("commit_ms", 9), ("sum_ms", 7), ("gather_ms", 9), ("sum_%", 6), ("load_ms", 8), ("verify_ms", 9), ("agree_ms", 8)]
    table_rows = []
    for r in rows:
        pct = share(r)
        table_rows.append([r["recipe"], r["mode"], "on" if r["checksums"] else "off", f"{r['bytes'] / 1e6:.1f}",
                f"{r['save_ms']:.1f}", f"{r['stall_ms']:.1f}",
                f"{r['writer_ms']:.1f}" if r.get("writer_ms") else "-", f"{r['commit_ms']:.1f}",
                f"{r['sum_ms']:.2f}" if "sum_ms" in r else "-", f"{r['gather_ms']:.2f}" if "gather_ms" in r else "-",
                f"{pct:.1f}" if pct is not None else "-", f"{r['load_ms']:.1f}",
                f"{r['verify_ms']:.1f}", f"{r['agree_ms']:.1f}"])
    lines = fixed_width(cols, table_rows)
    lines.append(f"device: {DEVICE}; medians over the saves after the first, and over the loads")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--saves", type=int, default=8, help="iterations, one save each (the first is left out)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--loads", type=int, default=3, help="loads of the last checkpoint (their medians)")
    p.add_argument("--smoke", action="store_true", help="seconds: tiny_dense, 3 saves and 1 load per case")
    a = p.parse_args(argv)
    if a.smoke:
        a.recipes, a.saves, a.loads = ["tiny_dense"], 3, 1
    # a fresh world of processes per case (megatron_ext.measure.launch): they log to stderr
    rows = [run_case(recipe, a.saves, mode, sums, a.loads) for recipe in a.recipes for mode in (False, True)
            for sums in (True, False)]
    for r in rows:
        r["sum_pct"] = share(r)
    print(json.dumps({"device": DEVICE, "rows": rows}, indent=1) if a.json else table(rows))


if __name__ == "__main__":
    main()
