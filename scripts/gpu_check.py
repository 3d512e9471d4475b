"""Every claim this project makes about one GPU, checked and measured by one command.

    python3 scripts/gpu_check.py [--out docs/gpu] [--sections cuda_facts,multihot,...] [--budget-s 1080]
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
                    dropless/capacity/capacity-nopad: syncs forward/backward (SyncDetector, and
                    set_sync_debug_mode("error") for the sync-free claims), agreement, time
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
transformer_engine  the transformer-engine spec builds, trains a few steps with offload hooks that
                    capture bytes; or why not (not importable). And megatron's EP overlap with
                    --delay-wgrad-compute passes a CUDA dry run (EP2, so not run on one GPU), with
                    this machine's transformer-engine where it imports

``--cpu-smoke`` runs every section at tiny sizes on CPU, so this script cannot rot: what only a GPU
can measure reads "skipped: no CUDA". Exit code 0 when every section ran and every claim held.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform as pyplatform
import re
import socket
import subprocess
import sys
import time
import traceback


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from gpu_check_sections import RUNNERS, SECTIONS  # noqa: E402
from gpu_check_sections.common import cuda, package_version  # noqa: E402
# the planner section's cases, read by tests
from gpu_check_sections.planner import PLAN_CASES  # noqa: E402,F401


SCHEMA = 1

# Sizes: "gpu" is what one H100/H200 measures within the budget; "smoke" exercises the same code.
SIZES = {
    "gpu": dict(
        multihot_tokens=(4096, 16384, 65536, 131072), multihot_experts=(8, 64, 256), multihot_reps=20,
        layers=[dict(name="8 experts top-2, h4096 ffn4096", experts=8, topk=2, hidden=4096, ffn=4096, seq=4096),
                dict(name="64 experts top-8, h2048", experts=64, topk=8, hidden=2048, ffn=1024, seq=4096)],
        layer_reps=5,
        offload=dict(dense=dict(model="dense", layers=8, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                                ffn=16384, microbatches=1),
                     moe=dict(model="moe", layers=4, hidden=4096, heads=32, seq=4096, mbs=1, vocab=32000,
                              ffn=16384, experts=8, topk=2, moe_ffn=4096, shared=4096, microbatches=1)),
        offload_depths=(4, 16), offload_reps=5, copy_bytes=256 << 20,
        train_extra=["--bf16"],
        plan_extra=["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
                    "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
                    "--micro-batch-size", "1", "--global-batch-size", "4", "--bf16"],
    ),
    "smoke": dict(
        multihot_tokens=(64, 512), multihot_experts=(8,), multihot_reps=2,
        layers=[dict(name="4 experts top-2, h32", experts=4, topk=2, hidden=32, ffn=64, seq=16)],
        layer_reps=1,
        offload=dict(dense=dict(model="dense", layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                                microbatches=2),
                     moe=dict(model="moe", layers=2, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
                              experts=4, topk=2, moe_ffn=64, shared=64, microbatches=2)),
        offload_depths=(2,), offload_reps=1, copy_bytes=1 << 20,
        train_extra=[],
        plan_extra=[],
    ),
}


# ------------------------------------------------------------------------------------------------ helpers
def device_name() -> str:
    return torch.cuda.get_device_name() if cuda() else "cpu"


def host_info() -> dict:
    from megatron_ext.platform import target

    info = {
        "python": pyplatform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "megatron_core": package_version("megatron-core"), "transformer_engine": package_version("transformer-engine"),
        "transformer_engine_importable": target.te_importable(), "apex_kernels_importable": target.apex_importable(),
        "cpu_count": os.cpu_count(),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    }
    if cuda():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, compute_capability=f"{p.major}.{p.minor}", memory_bytes=p.total_memory,
                    multiprocessors=p.multi_processor_count)
    try:
        info["commit"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                                        timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


# ------------------------------------------------------------------------------------------------ output
def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and abs(v) >= 1 << 20:
        return f"{v / 2**20:.1f} MiB"
    if isinstance(v, list):
        return " ".join(map(str, v))
    return "-" if v is None else str(v)


def _table(rows: list, cols: list) -> list:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def markdown(doc: dict) -> str:
    lines = [f"# GPU check: {doc['device']}, {doc['date']}", "",
             f"`scripts/gpu_check.py{' --cpu-smoke' if doc['mode'] == 'cpu-smoke' else ''}`, {doc['elapsed_s']:.0f} s; "
             f"torch {doc['host']['torch']} (CUDA {doc['host']['cuda_runtime']}), megatron-core "
             f"{doc['host']['megatron_core']}, transformer-engine {doc['host']['transformer_engine'] or 'absent'}.", "",
             "## Claims", ""]
    lines += _table([{"claim": c["claim"], "holds": c["holds"]} for c in doc["claims"]], ["claim", "holds"])
    s = doc["sections"]
    lines += ["", "## Sections", ""]
    lines += _table([{"section": k, "status": v.get("status"), "seconds": v.get("seconds")} for k, v in s.items()],
                    ["section", "status", "seconds"])
    if s.get("cuda_facts", {}).get("status") == "ok":
        lines += ["", "## CUDA facts", ""]
        keys = ["backward_on_other_thread", "threading_local_seen_in_backward", "event_done_right_after_enqueue",
                "event_done_after_synchronize"]
        lines += _table([{"fact": k, "observed": s["cuda_facts"][k]} for k in keys], ["fact", "observed"])
    if s.get("multihot", {}).get("rows"):
        lines += ["", "## indices_to_multihot vs megatron-core", ""]
        lines += _table(s["multihot"]["rows"], ["tokens", "experts", "topk", "bitwise_equal_at_shape",
                                                "cuda_syncs_reference", "cuda_sync_free_ours", "time_reference_ms",
                                                "time_ours_ms", "time_ours_over_reference"])
    if s.get("moe_layer", {}).get("rows"):
        lines += ["", "## MoE layer, EP=1, forward+backward", ""]
        lines += _table(s["moe_layer"]["rows"], ["layer", "dispatcher", "mode", "syncs_forward", "syncs_backward",
                                                 "cuda_syncs_forward", "cuda_syncs_backward", "cuda_sync_free_step",
                                                 "step_ms", "bitwise_equal_to_megatron"])
    if s.get("offload", {}).get("cases"):
        lines += ["", "## Activation offload, PP=1", ""]
        cases = [dict(r, layers=r["shape"]["layers"]) for r in s["offload"]["cases"]]
        lines += _table(cases, ["model", "layers", "modules", "peak_off_bytes", "peak_on_bytes", "saved_bytes",
                                "theoretical_bytes", "R", "bytes_offloaded_per_step", "step_ms_off", "step_ms_on",
                                "step_overhead", "step_overhead_spread", "predicted_overhead", "grads_bitwise_equal"])
        lines += ["", "theoretical_bytes: offload/theory.py's saving with the peak inside a layer's backward "
                  "(resident: the last layer, never copied, and the prefetch window); step times: medians of "
                  "interleaved off/on repetitions, spread = [min, max] of the overhead; predicted_overhead: "
                  "planner/steptime.py from the bytes, the measured host link and layer compute."]
        lines += ["", "Host link: " + ", ".join(f"{k} {_fmt(v)}" for k, v in s["offload"]["host_link"].items())]
    if s.get("planner", {}).get("rows"):
        lines += ["", "## Planner: predicted vs measured peak, PP=1", ""]
        lines += _table(s["planner"]["rows"], ["case", "predicted_peak_bytes", "measured_peak_bytes", "measured_by",
                                               "error", "megatron_estimate_bytes"])
    for name in ("train", "transformer_engine"):
        sec = s.get(name, {})
        runs = [v for v in sec.values() if isinstance(v, dict) and "losses" in v]
        if "losses" in sec:
            runs.append(sec)
        if runs:
            lines += ["", f"## {name}", ""]
            lines += _table([{"run": " ".join(r["argv"][1:2]).replace(ROOT + os.sep, ""), "losses": r["losses"],
                              "offloaded_bytes": r["offloaded_bytes"], "dispatchers_replaced": r["dispatchers_replaced"]}
                             for r in runs], ["run", "losses", "offloaded_bytes", "dispatchers_replaced"])
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def stdout_to_stderr():
    """While sections run, everything written to stdout (megatron's log handlers, train.py's log
    lines) goes to stderr: stdout carries only the final tables."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def single_process_env():
    """A world of one process for megatron's process groups; the caller's environment comes back."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    for key, value in zip(keys, ("0", "0", "1", "127.0.0.1", port)):
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (CI): the same code paths")
    ap.add_argument("--out", default=None, help="output folder (default: docs/gpu; with --cpu-smoke: nothing written "
                    "unless given)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=1080.0,
                    help="sections not started within this many seconds are reported skipped")
    a = ap.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
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

    from megatron_ext import platform

    t0 = time.time()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    device = device_name() if not a.cpu_smoke else "cpu (smoke)"
    doc = {"schema": SCHEMA, "mode": "cpu-smoke" if a.cpu_smoke else "gpu", "date": date, "device": device,
           "host": host_info(), "sections": {}, "claims": [], "elapsed_s": 0.0}
    base = os.path.join(out_dir, f"{date}-{slug(device)}") if out_dir else None

    def write():
        doc["elapsed_s"] = round(time.time() - t0, 1)
        if base:
            os.makedirs(out_dir, exist_ok=True)
            with open(base + ".json", "w") as f:
                json.dump(doc, f, indent=1, default=str)

    with single_process_env(), stdout_to_stderr():
        started_pg = not torch.distributed.is_initialized()
        platform.init_distributed()
        try:
            for name in SECTIONS:
                if name not in sections:
                    doc["sections"][name] = {"status": "skipped: not selected"}
                    continue
                if time.time() - t0 > a.budget_s:
                    doc["sections"][name] = {"status": f"skipped: time budget ({a.budget_s:.0f} s) spent"}
                    continue
                print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
                ts = time.time()
                claims: list = []
                try:
                    result = RUNNERS[name](size, claims)
                except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others' evidence
                    result = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                    print(result["traceback"], file=sys.stderr)
                result["seconds"] = round(time.time() - ts, 1)
                for c in claims:
                    c["section"] = name
                doc["sections"][name] = result
                doc["claims"] += claims
                write()
        finally:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                from megatron_ext.training import parallel

                parallel.destroy()
            if started_pg and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
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
