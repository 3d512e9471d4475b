"""Every claim this project makes about one GPU, checked and measured by one command.

    python3 scripts/gpu_check.py [--out docs/gpu] [--sections cuda_facts,multihot,...] [--budget-s 480]
    python3 scripts/gpu_check.py --sections fp8,long_context   # FP8 against bf16, CP kernels: runs of their own
    python3 scripts/gpu_check.py --cpu-smoke [--out DIR]      # the same code paths, tiny sizes, on CPU

Writes ``<out>/<date>-<device>.json`` (rewritten after every section, so an interrupted run keeps what
it measured) and ``<out>/<date>-<device>.md``, the markdown tables it also prints. Sections:

cuda_facts          what the CPU platform simulates, checked on the device: backward nodes of CUDA
                    tensors run on a thread other than the caller's (threading.local is not carried);
                    an event recorded after a D2H copy is not complete right after the host enqueues it
multihot            indices_to_multihot vs megatron-core's _indices_to_multihot, tokens up to 131072 x
                    experts up to 256: zero syncs under torch.cuda.set_sync_debug_mode("error"), the
                    reference's syncs counted by the same mode ("warn"), bit-identity at every shape,
                    time vs the reference (scripts/bench_dispatcher.py's bench_multihot)
moe_layer           one MoELayer, EP=1, megatron's and the sync-free dispatcher, alltoall/allgather x
                    dropless/capacity/capacity-nopad/zero-sync dropless, bf16: syncs forward/backward
                    (SyncDetector, set_sync_debug_mode), agreement with megatron under deterministic
                    algorithms (megatron's own run-to-run spread beside it), step time; the zero-sync
                    layer captured in a CUDA graph and replayed on another routing, its step against
                    megatron's dropless (interleaved), and in fp32 (its syncs, the refusal by name)
moe_graphs          train.py with a dropless MoE whose MoE layers are captured in CUDA graphs
                    (--cuda-graph-impl local --cuda-graph-modules moe, zero-sync layer): losses
                    bit-identical to eager, time per iteration of each; the flags' refusals by name
offload             PP=1, bf16, hidden 4096, seq 4096, dense at 4 / 8 / 16 layers and MoE, every
                    module set: peak memory (torch.cuda.max_memory_allocated) off vs on, saved /
                    modelled (offload/theory.py) = R, step time off and on interleaved (CUDA events,
                    median and spread) against the overhead the planner predicts from the bytes,
                    the host link (pinned copies) and the layer compute measured, gradients
                    bit-identical where offload off is bit-identical run to run
train               train.py end to end, a few iterations: the dense recipe with activation offload
                    and the MoE recipe with the sync-free dispatcher (the platform defaults of a GPU
                    without apex/transformer-engine, for real)
planner             the planner's predicted peak bytes (scripts/plan.py's model) against one measured
                    training step (scripts/bench/plan.measure: torch.cuda.max_memory_allocated on a
                    GPU, live tensor bytes on CPU), dense and MoE, PP=1, with and without offload
throughput          whole training steps through train.py's bring-up (Run): tokens/s, TFLOP/s (megatron's
                    FLOP formula, causal attention at half) and MFU against a bf16 matrix product
                    measured in the same run; gpu_check's dense model, a Llama-3-8B-shaped stack of as
                    many layers as fit, gpu_check's MoE; each unfused and with torch attention
                    (--attention-backend flash), core_attention offload off and on; the unfused run
                    with offload off is the baseline (every feature of this project off); torchtitan's
                    Llama-3 step at the same shape, in its own process (scripts/bench/titan.py)
transformer_engine  the transformer-engine spec builds, trains a few steps with offload hooks that
                    capture bytes; or why not (not importable). And megatron's EP overlap with
                    --delay-wgrad-compute passes a CUDA dry run (EP2, so not run on one GPU), with
                    this machine's transformer-engine where it imports
fp8                 FP8 on the local spec (--fp8-format hybrid --fp8-recipe tensorwise, torchao's float8)
                    against bf16, whole training steps on the throughput section's Llama-3-8B-shaped
                    case and its MoE case: tokens/s, TFLOP/s, MFU, FP8's speed-up; torchtitan's Float8
                    (not wired: its row says so); 50 steps' losses in FP8 and in bf16 on the same data
long_context        context parallelism's per-rank attention kernel time on one device: each comm type's
                    share of one CP rank (context_parallel.OneRank: the rank's own kernels, collectives
                    as local copies) at CP 2 and 4, forward + backward, the slowest rank against the
                    whole sequence's causal attention at CP 1 (Llama-3-8B's heads, 16384 tokens, bf16)

Each section runs in a process of its own, so what one leaves behind (CUDA graphs, pinned pools,
process groups, dead weak proxies) cannot reach the next: with CUDA a fresh interpreter (this script
with --section), without CUDA a process forked from a server that has imported torch and megatron-core
once (no CUDA can be initialised there). A section whose process dies (a native crash, a kill at its
time limit) is reported with its exit code and the tail of its output; the others still run. Sections
start only while the run's budget (--budget-s) has room for their estimated time, and each is stopped at
its own limit (ESTIMATE_S, docs/gpu/README.md's table).

``--cpu-smoke`` runs every section at tiny sizes on CPU, so this script cannot rot: what only a GPU
can measure reads "skipped: no CUDA". Exit code 0 when every section ran and no claim was found false.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform as pyplatform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench import preload  # noqa: E402
from gpu_check_sections import RUNNERS, SECTIONS, child  # noqa: E402
from gpu_check_sections.common import cuda, package_version  # noqa: E402
# the planner section's cases, read by tests
from gpu_check_sections.planner import PLAN_CASES  # noqa: E402,F401


SCHEMA = 2

# Device seconds per section on one H100/H200, a process's start (~8 s: interpreter, torch, megatron-core,
# CUDA context) included: the sections' measured seconds on the H200 of 2026-11-30 (docs/gpu/2026-11-30-h200-*:
# cuda_facts 15.9, multihot 16.1, moe_layer 51.4, moe_graphs 34.0, offload 70.6, train 41.9, throughput 130.5,
# fp8 82.6, long_context 48.0; the planner died after 28.0 s and transformer_engine was stopped at its 18 s
# limit) with a few seconds of margin; the planner's and transformer_engine's are their authors' estimates, as
# is fp8's share for its two zero-sync MoE rows and the grouped product's check (added since: +25 s).
ESTIMATE_S = {"cuda_facts": 18, "multihot": 18, "moe_layer": 60, "moe_graphs": 36, "offload": 75, "train": 45,
              "planner": 40, "throughput": 140, "transformer_engine": 30, "fp8": 115, "long_context": 55}
LIMIT_FACTOR = 1.5  # a section is stopped at this multiple of its estimate (or when the budget is spent)
BUDGET_S = 480.0  # the whole run: 8 minutes; the default sections' estimates must fit (tests/test_gpu_check.py)
# a GPU run's sections unless --sections names others: all but those a run of its own measures
# (`--sections fp8,long_context`: the whole run must end within one device call); --cpu-smoke runs every section
OWN_RUN = ("fp8", "long_context")
GPU_DEFAULT = tuple(s for s in SECTIONS if s not in OWN_RUN)
SMOKE_LIMIT_S = 300.0  # per section on CPU, where the estimates do not apply
TAIL_LINES = 40

# Sizes: "gpu" is what one H100/H200 measures within the budget; "smoke" exercises the same code.
SIZES = {
    "gpu": dict(
        multihot_tokens=(4096, 16384, 65536, 131072), multihot_experts=(8, 64, 256), multihot_reps=20,
        layers=[dict(name="8 experts top-2, h4096 ffn4096", experts=8, topk=2, hidden=4096, ffn=4096, seq=4096),
                dict(name="64 experts top-8, h2048", experts=64, topk=8, hidden=2048, ffn=1024, seq=4096)],
        layer_reps=5,
        # the offload section measures megatron's unfused attention (the s x s probabilities), as the device
        # record and offload/theory.py's default; offload with torch attention: the throughput section
        offload=dict(dense=dict(model="dense", layers=8, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                                ffn=16384, microbatches=1, attention="unfused"),
                     moe=dict(model="moe", layers=4, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                              ffn=16384, experts=8, topk=2, moe_ffn=4096, shared=4096, microbatches=1,
                              attention="unfused")),
        offload_depths=(4, 16), offload_reps=5, copy_bytes=256 << 20,
        train_extra=["--bf16"],
        plan_extra=["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
                    "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
                    "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16"],
        throughput="gpu",
        plan_cases=("dense", "dense offload", "moe", "moe offload"),
    ),
    "smoke": dict(
        multihot_tokens=(64, 512), multihot_experts=(8,), multihot_reps=2,
        layers=[dict(name="4 experts top-2, h32", experts=4, topk=2, hidden=32, ffn=64, seq=16)],
        layer_reps=1,
        offload=dict(dense=dict(model="dense", layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                                microbatches=2, attention="unfused"),
                     moe=dict(model="moe", layers=2, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                              experts=4, topk=2, moe_ffn=64, shared=64, microbatches=2, attention="unfused")),
        offload_depths=(2,), offload_reps=1, copy_bytes=1 << 20, offload_all_at_once=True,
        train_extra=[],
        plan_extra=[],
        throughput="smoke",
        # the rehearsal runs the planner section's code on the dense cases; tests/planner measures MoE
        plan_cases=("dense", "dense offload"),
    ),
}


# ------------------------------------------------------------------------------------------------ helpers
def gpu_query() -> dict:
    """The GPU as nvidia-smi describes it, without a CUDA context in this process (the sections' processes
    own the device; their cuda_facts records torch's view of it); {} where nvidia-smi does not answer."""
    fields = ("name", "memory.total", "compute_cap", "driver_version")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.stdout.strip().split(",")]
    if out.returncode != 0 or len(values) != len(fields):
        return {}
    name, memory_mib, capability, driver = values
    return {"device": name, "memory_bytes": int(float(memory_mib)) << 20 if memory_mib.replace(".", "").isdigit()
            else memory_mib, "compute_capability": capability, "driver": driver}


def host_info() -> dict:
    from megatron_ext.platform import target

    info = {
        "python": pyplatform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "megatron_core": package_version("megatron-core"), "transformer_engine": package_version("transformer-engine"),
        "torchtitan": package_version("torchtitan"),
        "transformer_engine_importable": target.te_importable(), "apex_kernels_importable": target.apex_importable(),
        "cpu_count": os.cpu_count(),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }
    if cuda():
        info.update(gpu_query())
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ output
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / 2**20:.1f} MiB"
    if isinstance(v, dict):
        if {"median", "min", "max"} <= set(v):
            return f"{_fmt(v['median'])} [{_fmt(v['min'])}, {_fmt(v['max'])}]"
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, list):
        return " ".join(_fmt(x) if isinstance(x, (float, dict)) else str(x) for x in v)
    return "-" if v is None else str(v).replace("|", "/").replace("\n", " ")


# Columns first in a table, in this order; every other key of the rows follows, so nothing is left out.
FIRST = {
    ("multihot", "rows"): ["tokens", "experts", "topk", "bitwise_equal_at_shape", "cuda_syncs_reference",
                           "cuda_sync_free_ours", "time_reference_ms", "time_ours_ms", "time_ours_over_reference"],
    ("moe_layer", "rows"): ["layer", "dispatcher", "mode", "syncs_forward", "syncs_backward", "cuda_syncs_forward",
                            "cuda_syncs_backward", "cuda_sync_free_step", "step_ms", "bitwise_equal_to_megatron"],
    ("moe_layer", "zero_sync"): ["layer", "dispatcher", "graph_forward_replay_equal", "graph_step_replay_equal",
                                 "step_ms", "megatron_dropless_step_ms"],
    ("offload", "cases"): ["model", "modules", "peak_off_bytes", "peak_on_bytes", "saved_bytes", "theoretical_bytes",
                           "R", "bytes_offloaded_per_step", "step_ms_off", "step_ms_on", "step_overhead",
                           "step_overhead_spread", "predicted_overhead", "grads_bitwise_equal"],
    ("planner", "rows"): ["case", "predicted_peak_bytes", "measured_peak_bytes", "measured_by", "error",
                          "megatron_estimate_bytes"],
    ("throughput", "rows"): ["case", "variant", "attention_kernel", "offload", "layers", "step_ms", "fwd_bwd_ms",
                             "tokens_per_s", "tflops", "mfu", "peak_bytes"],
}
TITLES = {"cuda_facts": "CUDA facts", "multihot": "indices_to_multihot vs megatron-core",
          "moe_layer": "MoE layer, EP=1, forward+backward", "moe_graphs": "Dropless MoE layers in CUDA graphs",
          "offload": "Activation offload, PP=1", "train": "train.py", "planner": "Planner: predicted vs measured peak, PP=1",
          "throughput": "Throughput: whole training steps", "transformer_engine": "transformer-engine"}
NOTES = {
    "offload": "theoretical_bytes: offload/theory.py's saving with the peak inside a layer's backward (resident: the "
               "last layer, never copied, and the prefetch window); step times: medians of interleaved off/on "
               "repetitions, spread = [min, max] of the overhead; predicted_overhead: planner/steptime.py from the "
               "bytes, the measured host link and layer compute.",
}
LONG_TEXT = ("traceback", "stderr_tail")


def _table(rows: list, first: list) -> list:
    cols = [c for c in first if any(c in r for r in rows)]
    for r in rows:
        cols += [c for c in r if c not in cols and c not in LONG_TEXT]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _long(key: str, text: str) -> list:
    tail = str(text).rstrip().splitlines()[-20:]
    return ["", f"{key} (last {len(tail)} lines):", "", "```", *tail, "```"]


def render_section(name: str, sec: dict) -> list:
    """Every key of a section: scalars as a table, a list of rows as a table (the union of their keys),
    a mapping of named runs as a table of them; tracebacks and output tails as code blocks."""
    lines = ["", f"## {TITLES.get(name, name)}", ""]
    scalars, tables, long = {}, [], []
    for key, value in sec.items():
        if key in LONG_TEXT:
            long.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            tables.append((key, value, FIRST.get((name, key), [])))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()) \
                and not {"median", "min", "max"} <= set(value):
            tables.append((key, [dict({key: k}, **v) for k, v in value.items()], [key]))
        else:
            scalars[key] = value
    lines += _table([{"key": k, "value": v} for k, v in scalars.items()], ["key", "value"])
    for key, rows, first in tables:
        lines += ["", f"{key}:", ""] + _table(rows, first)
        for r in rows:
            for lk in LONG_TEXT:
                if lk in r:
                    long.append((f"{key} {_fmt(r.get('model') or r.get('case') or '')} {lk}".replace("  ", " "), r[lk]))
    if name in NOTES:
        lines += ["", NOTES[name]]
    for key, text in long:
        lines += _long(key, text)
    return lines


def markdown(doc: dict) -> str:
    host = doc["host"]
    lines = [f"# GPU check: {doc['device']}, {doc['date']}", "",
             f"`scripts/gpu_check.py{' --cpu-smoke' if doc['mode'] == 'cpu-smoke' else ''}`, {doc['elapsed_s']:.0f} s"
             + (f" (budget {doc['budget_s']:.0f} s)" if "budget_s" in doc else "")
             + f"; torch {host['torch']} (CUDA {host['cuda_runtime']}), megatron-core {host['megatron_core']}, "
             f"transformer-engine {host['transformer_engine'] or 'absent'}, torchtitan {host.get('torchtitan') or 'absent'}"
             + (f"; sections in processes of their own ({doc['processes']})" if "processes" in doc else "") + ".", "",
             *([f"**{doc['stopped']}**", ""] if doc.get("stopped") else []),
             "## Claims", ""]
    lines += _table([{"section": c.get("section"), "claim": c["claim"], "holds": c["holds"]} for c in doc["claims"]],
                    ["section", "claim", "holds"])
    s = doc["sections"]
    lines += ["", "## Sections", ""]
    lines += _table([{"section": k, "status": v.get("status"), "seconds": v.get("seconds"),
                      "estimate_s": v.get("estimate_s"), "exit_code": v.get("exit_code")} for k, v in s.items()],
                    ["section", "status", "seconds", "estimate_s", "exit_code"])
    for name, sec in s.items():
        if set(sec) - {"status", "seconds", "estimate_s", "exit_code"}:
            lines += render_section(name, sec)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ processes
def plan_section(name: str, budget_s: float, left_s: float, smoke: bool) -> tuple:
    """(estimate, time limit, None) for a section that starts with ``left_s`` of the budget left, or
    (estimate, 0, the reason it is skipped). On a GPU a section starts only if its estimate fits and is
    stopped at LIMIT_FACTOR x its estimate or when the budget is spent; on CPU (no estimates) at
    SMOKE_LIMIT_S or the budget."""
    estimate = 0.0 if smoke else float(ESTIMATE_S[name])
    if left_s <= 0 or estimate > left_s:
        return estimate, 0.0, (f"skipped: time budget ({budget_s:.0f} s): {max(left_s, 0):.0f} s left, the section "
                               f"needs about {estimate:.0f} s")
    return estimate, min(SMOKE_LIMIT_S if smoke else LIMIT_FACTOR * estimate, left_s), None


def section_command(name: str, smoke: bool, result_file: str, limit_s: float) -> list:
    """A fresh interpreter running one section (this script with --section)."""
    return [sys.executable, os.path.abspath(__file__), "--section", name, "--result-file", result_file,
            "--time-limit-s", str(limit_s), *(["--cpu-smoke"] if smoke else [])]


def _exit_text(code) -> str:
    if code is not None and code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class _Follow(threading.Thread):
    """Echoes a section's output file to this process's stderr as it grows, keeping its last lines."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.tail, self.done = path, collections.deque(maxlen=TAIL_LINES), threading.Event()

    def run(self):
        with open(self.path, "rb") as f:
            pending = b""
            while True:
                chunk = f.read(1 << 16)
                if chunk:
                    sys.stderr.buffer.write(chunk) if hasattr(sys.stderr, "buffer") else sys.stderr.write(
                        chunk.decode(errors="replace"))
                    sys.stderr.flush()
                    *lines, pending = (pending + chunk).split(b"\n")
                    self.tail.extend(line.decode(errors="replace") for line in lines)
                elif self.done.is_set():
                    if pending:
                        self.tail.append(pending.decode(errors="replace"))
                    return
                else:
                    time.sleep(0.1)


def fork_server():
    """The forkserver context whose server preloads gpu_check_sections/preload.py (bench/preload.py).
    A server already running in this process (the test suite's) is used as it is: each child then
    imports what that server did not."""
    return preload.fork_server("gpu_check_sections.preload")


def run_in_process(name: str, smoke: bool, size: dict, limit_s: float, fresh: bool) -> tuple:
    """(result, claims) of one section run in a process of its own, stopped at ``limit_s``."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{name}_") as tmp:
        result_file, log_file = os.path.join(tmp, "result.json"), os.path.join(tmp, "output.log")
        open(log_file, "wb").close()
        follow = _Follow(log_file)
        follow.start()
        size = dict(size, time_limit_s=limit_s)
        if fresh:
            env = dict(os.environ, PYTHONPATH=preload.pythonpath())
            with open(log_file, "ab") as log:
                proc = subprocess.Popen(section_command(name, smoke, result_file, limit_s), stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)
            try:
                code = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                killed = True
            except BaseException:  # the run stopped: the section's process does not outlive it
                proc.kill()
                raise
            else:
                killed = False
        else:
            proc = fork_server().Process(target=child, args=(name, size, result_file, log_file))
            proc.start()
            try:
                proc.join(limit_s)
            except BaseException:
                proc.kill()
                raise
            killed = proc.is_alive()
            if killed:
                proc.kill()
                proc.join()
            code = proc.exitcode
        follow.done.set()
        follow.join()
        if os.path.exists(result_file) and not killed:
            with open(result_file) as f:
                payload = json.load(f)
            result, claims = payload["result"], payload["claims"]
            if code != 0:
                result["status"] = f"error: {_exit_text(code)} after its result was written ({result['status']})"
        else:
            why = f"stopped at its time limit ({limit_s:.0f} s)" if killed else f"its process died ({_exit_text(code)})"
            result, claims = {"status": f"error: {why}", "stderr_tail": "\n".join(follow.tail)}, []
        result["exit_code"] = code
        return result, claims


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (CI): the same code paths")
    ap.add_argument("--out", default=None, help="output folder (default: docs/gpu; with --cpu-smoke: nothing written "
                    "unless given)")
    ap.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}, run in the "
                    f"order given (default: all but {' and '.join(OWN_RUN)} on a GPU, all with --cpu-smoke)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="the whole run's time: a section starts only if its estimated time fits in what is left, "
                    "and is stopped when the budget is spent")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="without CUDA too, run each section in a fresh interpreter (the way a GPU run does)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a section's own process
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit-s", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.section is not None:
        child(a.section, dict(SIZES["smoke" if a.cpu_smoke else "gpu"], time_limit_s=a.time_limit_s), a.result_file)
        return 0  # not reached: the section's process ends in child()
    chosen = a.sections if a.sections is not None else ",".join(SECTIONS if a.cpu_smoke else GPU_DEFAULT)
    sections = [s for s in chosen.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"--sections: unknown {unknown[0]!r}; valid: {', '.join(SECTIONS)}")
    if a.cpu_smoke and cuda():
        ap.error("--cpu-smoke is the CPU rehearsal; on a GPU machine run without it")
    if not a.cpu_smoke and not cuda():
        print("error: no CUDA device here; use --cpu-smoke to rehearse on CPU", file=sys.stderr)
        return 2
    size = SIZES["smoke" if a.cpu_smoke else "gpu"]
    out_dir = a.out if a.out is not None else (None if a.cpu_smoke else os.path.join(ROOT, "docs", "gpu"))
    fresh = cuda() or a.fresh_processes  # CUDA cannot be initialised in a process forked from one that touched it

    t0 = time.time()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    host = host_info()  # nvidia-smi's view of the GPU, asked once
    device = "cpu (smoke)" if a.cpu_smoke else (host.get("device") or "cuda") if cuda() else "cpu"
    doc = {"schema": SCHEMA, "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "date": date, "device": device,
           "host": host, "budget_s": a.budget_s, "processes": "fresh interpreter" if fresh else "forked",
           "sections": {}, "claims": [], "elapsed_s": 0.0}
    base = os.path.join(out_dir, f"{date}-{slug(device)}") if out_dir else None

    def write():
        doc["elapsed_s"] = round(time.time() - t0, 1)
        if base:
            os.makedirs(out_dir, exist_ok=True)
            with open(base + ".json", "w") as f:
                json.dump(doc, f, indent=1, default=str)

    def stopped(signum, frame):  # `timeout` (scripts/gpu_run.sh): what was measured is kept, markdown too
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        for name in sections + [s for s in SECTIONS if s not in sections]:
            if name not in sections:
                doc["sections"][name] = {"status": "skipped: not selected"}
                continue
            estimate, limit, skipped = plan_section(name, a.budget_s, a.budget_s - (time.time() - t0), a.cpu_smoke)
            if skipped:
                doc["sections"][name] = {"status": skipped, "estimate_s": estimate}
                write()
                continue
            print(f"[gpu_check] {name} (estimate {estimate:.0f} s, limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
            ts = time.time()
            doc["sections"][name] = {"status": "error: the run was stopped while this section ran", "estimate_s": estimate}
            result, claims = run_in_process(name, a.cpu_smoke, size, limit, fresh)
            result.update(seconds=round(time.time() - ts, 1), estimate_s=estimate)
            for c in claims:
                c["section"] = name
            doc["sections"][name] = result
            doc["claims"] += claims
            write()
    except KeyboardInterrupt as e:
        doc["stopped"] = f"the run was stopped ({e or 'interrupted'}); the sections after it did not run"
    finally:
        signal.signal(signal.SIGTERM, previous)
    write()
    text = markdown(doc)
    if base:
        with open(base + ".md", "w") as f:
            f.write(text)
    print(text)
    if base:
        print(f"written: {base}.json, {base}.md", file=sys.stderr)
    ran = all(not v["status"].startswith("error") for v in doc["sections"].values())
    held = all(c["holds"] is True or isinstance(c["holds"], str) for c in doc["claims"])
    return 0 if ran and held else 1


if __name__ == "__main__":
    sys.exit(main())
