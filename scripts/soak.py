"""Soak: the distributed cases most exposed to races, repeated under CPU load, with faults injected.

    make soak                                   # N=2
    scripts/soak.py --repeats N [--parallel P] [--burn B] [--cases a,b] [--json]
    scripts/soak.py --smoke [--json]            # one case: one job killed mid-step, no reference job

Each case is a torchrun job of train.py (through tests/training/restart_probe.py, which records
every logged iteration as it happens and injects the faults) with --save/--load in one directory
and --max-restarts 1. Once per case an uninterrupted job is the reference; then N faulted jobs,
the fault rotating over the cases and repeats:

    step   SIGKILL of the last rank mid-step (after forward and backward of iteration 5)
    save   SIGKILL of the last rank mid-save (in the commit of the iteration-4 checkpoint)
    term   SIGTERM of the last rank mid-step at iteration 3 (a preemption: --exit-signal-handler
           saves and exits 0), then the job launched again as a requeued slurm job would be
           (SLURM_RESTART_COUNT=1)

The Megatron-FSDP cases under `optim` and `optim_grads` run without checkpoints (their
fsdp_dtensor save with SwiGLU is refused), so without faults: repeated for races and crashes only.
A faulted job must finish, and every iteration logged by any of its attempts must carry the
reference's loss and grad norm bit for bit. --smoke runs one job, killed mid-step, and no reference:
its restarted attempt must log the iterations its first attempt also logged (3 and 4: resumed from
2) with the first attempt's loss and grad norm, bit for bit. CPU load: P jobs run at once, plus B
processes that only spin. A native crash (a rank printing "Fatal Python error", or dying of a signal that was
not injected) is counted, and its rank-prefixed stack is printed.

Table columns: runs (jobs, references included), faults injected, restarts survived (restarts
after which the job finished with exact losses), losses exact (jobs whose every logged iteration
equals the reference), crashes (native crashes; target 0), failed (jobs that did not finish).
Not part of `make test`."""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from bench import fixed_width  # noqa: E402

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
PROBE = "tests/training/restart_probe.py"
ITERS = 6
COMMON = ["--train-iters", str(ITERS), "--log-interval", "100", "--save-interval", "2", "--exit-signal-handler",
          "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
DENSE = ["--recipe", "recipes/tiny_dense.yaml"]
MOE = ["--recipe", "recipes/tiny_moe.yaml"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy"]
CASES = {  # name -> (world size, train.py arguments)
    # no checkpoint, so no fault: their fsdp_dtensor save is refused (megatron-core's SwiGLU split,
    # docs/checkpointing.md); repeated for races and native crashes, losses compared all the same
    "fsdp-optim-nockpt": (2, DENSE + FSDP + ["optim"]),
    "fsdp-optim_grads-nockpt": (2, DENSE + FSDP + ["optim_grads"]),
    "fsdp-optim_grads_params": (2, DENSE + FSDP + ["optim_grads_params"]),
    "async-save-ep2-distopt": (2, MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                         "--async-save"]),
    "offload-pp2-vpp2": (2, DENSE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                     "1", "--activation-offload-modules", "core_attention", "qkv_linear", "attn_proj",
                                     "--activation-offload-min-tensor-kb", "0"]),
    "overlap-1f1b-moe-tp2": (2, MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--overlap-tp-comm-1f1b"]),
    "async-save-distopt": (2, DENSE + ["--use-distributed-optimizer", "--async-save"]),
}
SMOKE = "async-save-distopt"  # --smoke: one job with the first fault (step), its first attempt the reference
FAULTS = {"step": 5, "save": 4, "term": 3}  # fault -> iteration


# No port is chosen ahead of the launch: torchrun's c10d rendezvous binds port 0 on this host, so the
# OS hands its agent a free port as it binds it, and the agent keeps that store (the workers'
# MASTER_PORT) across --max-restarts. A port found free here and passed as --master-port stays
# free only until another process binds it: every gloo pair of every job running beside it listens
# on such a port, and torchrun binds its own seconds later (it imports torch first), so its static
# rendezvous could die with EADDRINUSE.
RENDEZVOUS = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]


def probe_command(world: int, records: str, kills: str, argv: list[str]) -> list[str]:
    """The torchrun command of one job of train.py under the restart probe (also
    tests/training/test_restart.py): `world` processes, one restart."""
    return [TORCHRUN, "--nproc-per-node", str(world), "--max-restarts", "1", "--monitor-interval", "0.1",
            *RENDEZVOUS, PROBE, records, kills, "--", *argv]


def _launch(world: int, argv: list[str], records: str, kills: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(probe_command(world, records, kills, argv), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def _records(records: str, rank: int) -> dict[int, list]:
    """attempt -> [(iteration, lm loss, grad norm), ...] as the last rank logged them."""
    out = {}
    for path in glob.glob(os.path.join(records, f"a*.r{rank}.jsonl")):
        attempt = int(re.search(r"a(\d+)\.r", os.path.basename(path)).group(1))
        with open(path) as f:
            out[attempt] = [(r["iteration"], r.get("lm loss"), r.get("grad norm")) for r in map(json.loads, f)]
    return out


def _crashes(text: str, injected: int) -> list[str]:
    """Native crashes in a job's output: the ranks' "Fatal Python error" stacks, and exits by a
    signal beyond the `injected` SIGKILLs."""
    found = []
    stacks = [line for line in text.splitlines() if re.match(r"^\[rank\d+\]: ", line)]
    if any("Fatal Python error" in line for line in stacks):
        found.append("\n".join(stacks[:80]))
    signals = re.findall(r"\(exitcode: (-\d+)\)", text)
    extra = [s for s in signals if s != "-9"] + signals[: max(0, signals.count("-9") - injected)]
    if extra:
        found.append(f"ranks died by signal {', '.join(extra)}")
    return found


def run_job(case: str, fault: str | None, work: str, faithful: bool) -> dict:
    world, argv = CASES[case]
    directory = tempfile.mkdtemp(prefix=f"{case}-{fault or 'ref'}-", dir=work)
    records, save = os.path.join(directory, "records"), os.path.join(directory, "ckpt")
    os.makedirs(records)
    checkpoints = not case.endswith("-nockpt")
    argv = argv + COMMON + (["--save", save, "--load", save] if checkpoints else [])
    fault = fault if checkpoints else None
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("SLURM_RESTART_COUNT", None)
    env.pop("RANK", None)
    if faithful:
        env["MEGATRON_EXT_CUDA_FAITHFUL"] = "1"
    last = world - 1
    kills = f"0:{last}:{FAULTS[fault]}:{fault}" if fault else ""
    t0 = time.perf_counter()
    done = _launch(world, argv, records, kills, env)
    outputs = [done.stdout + done.stderr]
    said = [line for line in done.stdout.splitlines() if line.startswith(("[checkpoint]", "[restart]"))]
    seen = _records(records, last)
    if done.returncode == 0 and fault == "term" and seen and max(r[0] for r in seen[max(seen)]) < ITERS:
        done = _launch(world, argv, records, kills, dict(env, SLURM_RESTART_COUNT="1"))  # requeued
        outputs.append(done.stdout + done.stderr)
        said += [line for line in done.stdout.splitlines() if line.startswith(("[checkpoint]", "[restart]"))]
        seen = _records(records, last)
    text = "\n".join(outputs)
    logged = [r for attempt in sorted(seen) for r in seen[attempt]]
    finished = done.returncode == 0 and bool(logged) and logged[-1][0] == ITERS
    checkpoints = sorted(os.listdir(save)) if os.path.isdir(save) else []
    shutil.rmtree(directory, ignore_errors=True)
    return {"case": case, "fault": fault, "finished": finished, "rc": done.returncode,
            "attempts": len(seen), "logged": logged, "seconds": round(time.perf_counter() - t0, 1),
            "first": seen.get(min(seen)) if seen else [],  # the first attempt's rows: --smoke's reference
            "iterations": [[row[0] for row in seen[a]] for a in sorted(seen)],  # logged by the last rank, per attempt
            "sigkills": text.count("(exitcode: -9)"), "said": said, "checkpoints": checkpoints,
            "crashes": _crashes(text, injected=1 if fault in ("step", "save") else 0),
            "tail": None if finished else text[-3000:]}


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:]))
    parser.add_argument("--repeats", type=int, default=2, help="faulted jobs per case (N)")
    parser.add_argument("--parallel", type=int, default=2, help="jobs run at once (CPU load)")
    parser.add_argument("--burn", type=int, default=1, help="extra processes that only spin (CPU load)")
    parser.add_argument("--cases", default=",".join(c for c in CASES if c != SMOKE),
                        help="comma-separated, of: " + ", ".join(CASES) + f" (all but {SMOKE} by default)")
    parser.add_argument("--no-faithful", action="store_true", help="without the CUDA-faithful CPU mode")
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument("--smoke", action="store_true", help=f"seconds: one {SMOKE} job killed mid-step, its "
                        "restarted attempt compared with its first, no spinning process (the suite's run)")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.cases, opts.repeats, opts.parallel, opts.burn = SMOKE, 1, 1, 0
    cases = opts.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}")
    faults = list(FAULTS)
    jobs = [] if opts.smoke else [(case, None) for case in cases]
    jobs += [(case, faults[(i + r) % len(faults)]) for r in range(opts.repeats) for i, case in enumerate(cases)]
    # a -nockpt case's repeats run without a fault (run_job drops it)
    work = tempfile.mkdtemp(prefix="soak-")
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(opts.burn)]
    for p in burners:
        p.start()
    t0 = time.perf_counter()
    try:
        references = {}
        with concurrent.futures.ThreadPoolExecutor(opts.parallel) as pool:
            results = list(pool.map(lambda job: run_job(*job, work, not opts.no_faithful), jobs))
    finally:
        for p in burners:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)
    for r in results:
        if r["fault"] is None:
            references[r["case"]] = {row[0]: row for row in r["logged"]} if r["finished"] else None
    rows, totals = [], dict(runs=0, faults=0, restarts=0, exact=0, crashes=0, failed=0)
    for case in cases:
        mine = [r for r in results if r["case"] == case]
        reference = references.get(case)
        for r in mine:
            if opts.smoke:  # the restarted attempt against the first, on the iterations both logged
                first = {row[0]: row for row in r["first"]}
                again = [row for row in r["logged"][len(r["first"]):] if row[0] in first]
                r["exact"] = r["finished"] and r["attempts"] > 1 and bool(again) and all(
                    first[row[0]] == row for row in again)
            else:
                r["exact"] = bool(reference) and r["finished"] and all(
                    reference.get(row[0]) == row for row in r["logged"])
        row = dict(runs=len(mine), faults=sum(r["fault"] is not None for r in mine),
                   restarts=sum(r["attempts"] - 1 for r in mine if r["exact"] and r["fault"]),
                   exact=sum(r["exact"] for r in mine), crashes=sum(len(r["crashes"]) for r in mine),
                   failed=sum(not r["finished"] for r in mine))
        for key in totals:
            totals[key] += row[key]
        rows.append([case, *row.values()])
    summary = {"cases": cases, "repeats": opts.repeats, "parallel": opts.parallel, "burn": opts.burn,
               "faithful": not opts.no_faithful, "seconds": round(time.perf_counter() - t0, 1),
               "totals": totals,
               "jobs": [{k: v for k, v in r.items() if k not in ("logged", "first")} for r in results]}
    if opts.json:
        print(json.dumps(summary, indent=1))
        return summary
    cols = [("case", 24), ("runs", 5), ("faults injected", 15), ("restarts survived", 17), ("losses exact", 12),
            ("crashes", 7), ("failed", 6)]
    for line in fixed_width(cols, rows + [["total", *totals.values()]]):
        print(line)
    print(f"{len(jobs)} jobs, {opts.parallel} at once and {opts.burn} spinning processes, "
          f"{'CUDA-faithful' if not opts.no_faithful else 'plain'} CPU mode, {summary['seconds']:.0f} s")
    for r in results:
        for crash in r["crashes"]:
            print(f"\nnative crash in {r['case']} ({r['fault'] or 'reference'}):\n{crash}")
        if not r["finished"]:
            print(f"\n{r['case']} ({r['fault'] or 'reference'}) did not finish (exit code {r['rc']}):\n{r['tail']}")
    return summary


if __name__ == "__main__":
    out = main()
    sys.exit(1 if out["totals"]["crashes"] or out["totals"]["failed"] or
             out["totals"]["exact"] != out["totals"]["runs"] else 0)
