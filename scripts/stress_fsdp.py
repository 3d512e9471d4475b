"""Megatron-FSDP under load: the FSDP runs repeated, several at once, each a fresh 2-process world, and
every way a run can end counted. A native crash (a rank killed by a signal: SIGABRT from glibc's heap
checks, SIGSEGV) is what this looks for.

    .venv/bin/python scripts/stress_fsdp.py [--runs 10] [--repeat 3] [--at-once 2] [--cases ...]
                                            [--budget-s 900] [--malloc-check] [--faithful] [--json [PATH]]

Cases (tiny recipes, 4 iterations of train.py's main on 2 ranks):
  optim, optim_grads, optim_grads_params   recipes/tiny_dense.yaml under each
                                           --data-parallel-sharding-strategy
  moe_optim_grads_params                   recipes/tiny_moe.yaml, optim_grads_params
  async_save                               tiny_dense, optim_grads_params, --async-save of fsdp_dtensor
                                           checkpoints every 2 iterations (megatron-core's forked writer)
Each world is a fresh `torchrun --nproc-per-node 2` whose ranks run `--repeat` trainings one after
another (as the test suite's persistent workers do). Worlds are started round-robin over the cases,
`--at-once` at a time (2 x 2 processes on a 2-core machine: the load under which the crashes were
seen), until every case has had `--runs` worlds or `--budget-s` seconds have passed (the table says
how many ran).

--malloc-check: glibc's checking allocator in every rank (PYTHONMALLOC=malloc, MALLOC_CHECK_=3,
libc_malloc_debug preloaded where present), so a write into freed memory aborts sooner.
--faithful: the CUDA-faithful CPU mode (megatron_ext/platform/faithful.py), as the test suite runs.
Every rank runs with faulthandler on, so a native crash prints its Python stacks; a crashed or failed
world's log is kept under --logs.

Columns: worlds; trainings (finished); ok (worlds that exited 0); crashed (a rank ended by a signal);
failed (a non-zero exit without a signal); hung (past --timeout-s, killed); exact (trainings whose
4 losses equal the case's first training's, bit for bit); signals (of the crashes).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import fixed_width  # noqa: E402

COMMON = ["--train-iters", "4", "--lr-warmup-iters", "1", "--log-interval", "1",
          "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data"]
MOE = ["--recipe", "recipes/tiny_moe.yaml"]


def _strategy(name: str) -> list[str]:
    return ["--data-parallel-sharding-strategy", name]


CASES = {
    "optim": DENSE + _strategy("optim"),
    "optim_grads": DENSE + _strategy("optim_grads"),
    "optim_grads_params": DENSE + _strategy("optim_grads_params"),
    "moe_optim_grads_params": MOE + _strategy("optim_grads_params"),
    "async_save": DENSE + _strategy("optim_grads_params") + ["--async-save", "--save-interval", "2"],
}
MALLOC_DEBUG = "/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
SIGNAL = re.compile(r"exitcode\s*:\s*(-\d+)")  # torchrun's report of a rank killed by a signal


def environment(args) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env["MEGATRON_EXT_CUDA_FAITHFUL"] = "1" if args.faithful else "0"
    if args.malloc_check:
        env.update(PYTHONMALLOC="malloc", MALLOC_CHECK_="3")
        if os.path.exists(MALLOC_DEBUG):
            env["LD_PRELOAD"] = MALLOC_DEBUG
    return env


class Run:
    def __init__(self, case: str, index: int, args, env: dict, workdir: str):
        self.case, self.index = case, index
        self.dir = os.path.join(workdir, f"{case}-{index}")
        os.makedirs(self.dir)
        worker = ["--worker", str(args.repeat)]
        if case == "async_save":
            worker += ["--save-base", os.path.join(self.dir, "ckpt")]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), *worker, "--", *CASES[case], *COMMON]
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.start = time.monotonic()
        self.timeout = args.timeout_s
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def poll(self):
        """None while running; else (outcome, losses, signal or None)."""
        code = self.proc.poll()
        if code is None:
            if time.monotonic() - self.start < self.timeout:
                return None
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
            code = "timeout"
        self.log.close()
        text = open(os.path.join(self.dir, "log"), errors="replace").read()
        signals = [int(s) for s in SIGNAL.findall(text)]
        crashed = [s for s in signals if s not in (-15, -9)]  # the agent's SIGTERM of the survivors
        trainings = [json.loads(line[len(DONE):]) for line in text.splitlines() if line.startswith(DONE)]
        if code == "timeout":
            return "hung", trainings, None
        if crashed:
            return "crashed", trainings, crashed[0]
        return ("ok" if code == 0 else "failed"), trainings, None


DONE = "STRESS_FSDP training done: "


def worker(argv: list[str]) -> None:
    """One rank of a world: `repeat` trainings in this process, one after another (as the test
    suite's persistent workers run them); rank 0 prints each one's losses."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--save-base", default=None)
    args, train_argv = p.parse_known_args(argv)
    train_argv = [a for a in train_argv if a != "--"]
    from train import main as train_main

    for i in range(args.worker):
        extra = ["--save", os.path.join(args.save_base, str(i))] if args.save_base else []
        history = train_main(train_argv + extra)
        if os.environ.get("RANK") == "0":
            print(DONE + json.dumps([h["lm loss"] for h in history]), flush=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="worlds per case")
    p.add_argument("--repeat", type=int, default=3, help="trainings one after another in each world's processes")
    p.add_argument("--at-once", type=int, default=2, help="2-process worlds running at the same time")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--budget-s", type=float, default=900, help="no new run starts after this many seconds")
    p.add_argument("--timeout-s", type=float, default=300, help="a run taking longer is killed and counted hung")
    p.add_argument("--malloc-check", action="store_true")
    p.add_argument("--faithful", action="store_true")
    p.add_argument("--logs", default=None, help="keep every crashed run's log here (default: a temporary folder)")
    p.add_argument("--json", nargs="?", const="-", default=None, help="write the result as JSON (to PATH, or stdout)")
    args = p.parse_args(argv)

    env = environment(args)
    workdir = tempfile.mkdtemp(prefix="stress_fsdp_")
    logs = args.logs or os.path.join(workdir, "crashes")
    os.makedirs(logs, exist_ok=True)
    queue = [(case, i) for i in range(args.runs) for case in args.cases]
    table = {c: {"worlds": 0, "trainings": 0, "ok": 0, "crashed": 0, "failed": 0, "hung": 0, "exact": 0,
                 "signals": []}
             for c in args.cases}
    reference, running, started = {}, [], time.monotonic()
    try:
        while queue or running:
            while queue and len(running) < args.at_once and time.monotonic() - started < args.budget_s:
                running.append(Run(*queue.pop(0), args, env, workdir))
            if not running:
                break  # budget spent
            time.sleep(0.2)
            for run in list(running):
                result = run.poll()
                if result is None:
                    continue
                running.remove(run)
                outcome, trainings, sig = result
                row = table[run.case]
                row["worlds"] += 1
                row["trainings"] += len(trainings)
                row[outcome] += 1
                for losses in trainings:
                    ref = reference.setdefault(run.case, losses)
                    row["exact"] += int(losses == ref and len(losses) == 4)
                if outcome != "ok":
                    if sig is not None:
                        row["signals"].append(sig)
                    shutil.copy(os.path.join(run.dir, "log"), os.path.join(logs, f"{run.case}-{run.index}.log"))
                    print(f"{run.case} #{run.index}: {outcome}" + (f" (signal {-sig})" if sig else ""), flush=True)
                shutil.rmtree(run.dir, ignore_errors=True)
    finally:
        for run in running:
            os.killpg(run.proc.pid, 9)
    elapsed = time.monotonic() - started
    result = {"cases": table, "seconds": round(elapsed, 1), "at_once": args.at_once, "repeat": args.repeat,
              "malloc_check": args.malloc_check, "faithful": args.faithful, "logs": logs}
    keys = ("worlds", "trainings", "ok", "crashed", "failed", "hung", "exact")
    cols = [("case", 24), ("worlds", 6), ("trainings", 9), ("ok", 4), ("crashed", 7), ("failed", 6), ("hung", 4),
            ("exact", 5), ("signals", 8)]
    rows = [[c, *(r[k] for k in keys), ",".join(str(-s) for s in r["signals"]) or "-"] for c, r in table.items()]
    total = {k: sum(r[k] for r in table.values()) for k in keys}
    rows.append(["all", *total.values(), "-"])
    for line in fixed_width(cols, rows):
        print(line)
    print(f"{elapsed:.0f} s, {args.at_once} worlds at once, {args.repeat} trainings per world, "
          f"malloc check {'on' if args.malloc_check else 'off'}, faithful mode {'on' if args.faithful else 'off'}; "
          f"crashed runs' logs: {logs}")
    if args.json == "-":
        print(json.dumps(result, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not args.logs and not os.listdir(logs):
        shutil.rmtree(workdir, ignore_errors=True)
    return result


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[1:])
    else:
        main()
