"""How long a command takes to start: `train.py --help`, `scripts/plan.py --help`, `scripts/convert.py
--help`, `scripts/prepare_data.py --help` and `train.py --dry-run` on the tiny recipe, for this checkout
and for an earlier commit (`--before REF`, extracted with `git archive` into a temporary directory and
run with the same interpreter), side by side. Each command runs --repeats times in a fresh process;
the median wall and CPU (user + system) seconds are shown. train.py's and prepare_data.py's --help
cache their text (megatron_ext/helptext.py): the cache starts empty, and the first run, which fills
it, is shown as its own row.

    python scripts/bench_startup.py [--before REF] [--repeats N] [--json]
    python scripts/bench_startup.py --smoke [--json]    # the two --help that import no torch, once: a second

A table on stdout (the machine, its load, the numbers); with --json only JSON. Timings on a shared
machine are noisy: CPU seconds move less than wall seconds there.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUN = ["train.py", "--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--dry-run"]
COMMANDS = {
    "train.py --help (first run)": ["train.py", "--help"],
    "train.py --help": ["train.py", "--help"],
    "scripts/plan.py --help": ["scripts/plan.py", "--help"],
    "scripts/convert.py --help": ["scripts/convert.py", "--help"],
    "scripts/prepare_data.py --help (first run)": ["scripts/prepare_data.py", "--help"],
    "scripts/prepare_data.py --help": ["scripts/prepare_data.py", "--help"],
    "train.py --dry-run (tiny_dense)": DRY_RUN,
}
SMOKE = ["scripts/plan.py --help", "scripts/convert.py --help"]  # answered without importing torch


def machine() -> dict:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "load average": os.getloadavg()[0]}


def run_once(tree: str, argv: list[str], cache: str) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the child, exit status) of one command in a fresh process."""
    env = {**os.environ, "PYTHONPATH": tree, "XDG_CACHE_HOME": cache, "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=tree, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def measure(tree: str, repeats: int, names: list[str]) -> dict:
    cache = tempfile.mkdtemp(prefix="bench_startup_cache_")
    try:
        out = {}
        for name in names:
            argv = COMMANDS[name]
            runs = [run_once(tree, argv, cache) for _ in range(1 if "first run" in name else repeats)]
            out[name] = {"wall s": statistics.median(r[0] for r in runs), "cpu s": statistics.median(r[1] for r in runs),
                         "exit": max(r[2] for r in runs), "runs": len(runs)}
        return out
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def extract(ref: str) -> str:
    """The tree of commit `ref`, with this checkout's .venv and data/ linked in."""
    tree = tempfile.mkdtemp(prefix="bench_startup_before_")
    archive = subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    for name in (".venv", "data"):
        if os.path.exists(os.path.join(ROOT, name)):
            os.symlink(os.path.realpath(os.path.join(ROOT, name)), os.path.join(tree, name))
    return tree


def table(result: dict) -> str:
    from megatron_ext.planner.cli import grid

    sides = [s for s in ("before", "after") if s in result]
    head = ["command"] + [f"{s} {k}" for s in sides for k in ("wall s", "cpu s")]
    rows = [[name] + [f"{result[s][name]['wall s']:.2f}{'' if result[s][name]['exit'] == 0 else ' (exit ' + str(result[s][name]['exit']) + ')'}"
                      if k == "wall s" else f"{result[s][name]['cpu s']:.2f}" for s in sides for k in ("wall s", "cpu s")]
            for name in result["after"]]
    lines = grid([head, *rows]).split("\n")
    m = result["machine"]
    lines += ["", f"{m['host']}: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average "
              f"{m['load average']:.1f} before and {result['load average after']:.1f} after (a shared machine: noisy)",
              f"median of {result['repeats']} runs each; before = {result.get('before ref', '-')}, after = this checkout"]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="REF", help="an earlier commit to compare with (e.g. the branch's base)")
    p.add_argument("--repeats", type=int, default=3, help="runs per command (the median is shown)")
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.add_argument("--smoke", action="store_true", help=f"{' and '.join(SMOKE)} once each (the suite's run)")
    opts = p.parse_args(argv)
    names = SMOKE if opts.smoke else list(COMMANDS)
    if opts.smoke:
        opts.repeats = 1
    result = {"machine": machine(), "repeats": opts.repeats}
    if opts.before:
        tree = extract(opts.before)
        try:
            result["before ref"] = subprocess.run(["git", "rev-parse", "--short", opts.before], cwd=ROOT,
                                                  capture_output=True, text=True, check=True).stdout.strip()
            result["before"] = measure(tree, opts.repeats, names)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    result["after"] = measure(ROOT, opts.repeats, names)
    result["load average after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1) if opts.json else table(result))
    return result


if __name__ == "__main__":
    main()
