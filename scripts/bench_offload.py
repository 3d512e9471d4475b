"""Activation offload benchmark: per PP stage, peak device-resident activation bytes with and without
offload (independent tracker), the theoretical saving from shapes and schedule, R = saved / theoretical,
and whether loss and every gradient are bit-identical. Writes a memory-timeline PNG.

    PYTHONPATH=. .venv/bin/python scripts/bench_offload.py [--json out.json] [--png docs/offload_timeline.png]

Cases: PP=1, PP=2 1F1B, PP=2 x VPP=2; dense and MoE (all seven modules offloaded for MoE). On CPU the
tracker is megatron_ext.offload.memtrack.LiveBytesTracker (every live storage outside parameters,
gradients and the host pool, seen through a TorchDispatchMode). Step time is only meaningful on a GPU:
on CPU it is reported as "not measured on GPU".
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DENSE = ["qkv_linear", "core_attention", "attn_proj"]
MOE = ["qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act", "router_fc2", "shared_experts"]
MODEL = dict(layers=8, hidden=64, heads=4, seq=64, mbs=2, vocab=8192, ffn=256, experts=4, topk=2, moe_ffn=128,
             microbatches=4)
SCHEDULES = {"PP=1": dict(pp=1), "PP=2 1F1B": dict(pp=2), "PP=2xVPP=2": dict(pp=2, vpp=2)}
OFFLOAD = dict(pool_bytes=256 << 20, chunk_bytes=64 << 10, prefetch_depth=1, min_tensor_bytes=1024, debug=False,
               cross_pass_prefetch="after-forward")


def run_case(schedule: str, model: str, timeline: bool = False, offload=None):
    """Job (every rank): offload off vs on on the same model and data."""
    from megatron_ext.offload import theory
    from tests.offload import jobs

    moe = model == "moe"
    kw = dict(MODEL, **SCHEDULES[schedule], model=model, shared=128 if moe else 0)
    offload = offload or OFFLOAD
    r = jobs.compare(modules=MOE if moe else DENSE, steps=2, offload_kw=offload, track=True, timeline=timeline, **kw)
    pp, vpp = kw["pp"], kw.get("vpp")
    per_chunk = kw["layers"] // (pp * (vpp or 1))
    theo = theory.theoretical_saving(
        r["theory_group_bytes"], pp, vpp, r["pp_rank"], kw["microbatches"], per_chunk, offload["prefetch_depth"]
    )
    saved = r["peak_off"] - r["peak_on"]
    out = dict(
        schedule=schedule, model=model, pp_rank=r["pp_rank"], peak_off_bytes=r["peak_off"], peak_on_bytes=r["peak_on"],
        theoretical_bytes=theo, saved_bytes=saved, R=(saved / theo) if theo else None,
        grads_bitwise_equal=bool(r["grads_equal"] and r["losses_equal"]), group_bytes=r["theory_group_bytes"],
        inflight_passes=theory.inflight_passes(pp, vpp, r["pp_rank"], kw["microbatches"]),
        layers_per_chunk=per_chunk, offloaded_bytes=r["stats"]["offloaded_bytes"],
        kept_last_bytes=r["stats"]["kept_last_bytes"], prefetched_groups=r["stats"]["prefetched_groups"],
        on_demand_groups=r["stats"]["on_demand_groups"], step_time="not measured on GPU",
    )
    if timeline:
        out["timeline_off"], out["timeline_on"] = r["timeline_off"], r["timeline_on"]
    return out


def plot(cases, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 3.6), squeeze=False)
    for ax, c in zip(axes[0], cases):
        for key, label in (("timeline_off", "offload off"), ("timeline_on", "offload on")):
            ys = c[key]
            xs = [i / max(1, len(ys) - 1) for i in range(len(ys))]
            ax.plot(xs, [y / 2**20 for y in ys], label=label, lw=1)
        ax.set_title(f"{c['schedule']} {c['model']}, PP rank {c['pp_rank']} (R={c['R']:.3f})", fontsize=9)
        ax.set_xlabel("fraction of the step's ops (forward+backward)")
        ax.set_ylabel("device-resident activation MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to a file, or '-' for stdout)")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "offload_timeline.png"))
    ap.add_argument("--timeline-case", default="PP=2xVPP=2:moe")
    ap.add_argument("--overhead", action="store_true",
                    help="also time steps with/without offload (GPU only; on CPU: 'not measured on GPU')")
    ap.add_argument("--cross-pass-prefetch", choices=("off", "after-forward", "always"), default="after-forward",
                    help="as --activation-offload-cross-pass-prefetch")
    a = ap.parse_args(argv)
    OFFLOAD["cross_pass_prefetch"] = a.cross_pass_prefetch

    import torch

    from tests.dist import run_distributed

    device = "cuda" if torch.cuda.is_available() else "cpu (2 cores; device and host are the same memory)"
    cases = []
    for schedule, extra in SCHEDULES.items():
        world = extra["pp"]
        for model in ("dense", "moe"):
            want_tl = a.timeline_case == f"{schedule}:{model}"
            cases += run_distributed(world, "scripts.bench_offload:run_case", timeout=900,
                                     schedule=schedule, model=model, timeline=want_tl, offload=OFFLOAD)
    overhead = {"step_time": "not measured on GPU"}
    if a.overhead and torch.cuda.is_available():
        big = dict(MODEL, layers=8, hidden=1024, heads=16, seq=2048, mbs=1, vocab=32000, ffn=4096, microbatches=4)
        overhead = run_distributed(1, "tests.offload.jobs:time_steps", timeout=900, modules=DENSE,
                                   offload_kw=dict(OFFLOAD, chunk_bytes=4 << 20, min_tensor_bytes=64 << 10), **big)[0]
    timelines = [c for c in cases if "timeline_on" in c]
    if timelines and a.png:
        plot(timelines, a.png)
    for c in cases:
        c.pop("timeline_on", None), c.pop("timeline_off", None)

    hdr = f"{'schedule':<12} {'model':<6} {'rank':>4} {'peak off MiB':>12} {'peak on MiB':>12} " \
          f"{'theory MiB':>10} {'saved MiB':>10} {'R':>7} {'bitwise':>8}"
    print(f"device: {device}; step-time overhead: not measured on GPU")
    print(hdr)
    print("-" * len(hdr))
    for c in cases:
        print(f"{c['schedule']:<12} {c['model']:<6} {c['pp_rank']:>4} {c['peak_off_bytes'] / 2**20:>12.3f} "
              f"{c['peak_on_bytes'] / 2**20:>12.3f} {c['theoretical_bytes'] / 2**20:>10.3f} "
              f"{c['saved_bytes'] / 2**20:>10.3f} {c['R']:>7.4f} {str(c['grads_bitwise_equal']):>8}")
    if a.png and timelines:
        print(f"timeline: {a.png}")
    print(f"overhead: {overhead}")
    if a.json:
        doc = json.dumps({"device": device, "cases": cases, "overhead": overhead}, indent=1)
        if a.json == "-":
            print(doc)
        else:
            with open(a.json, "w") as f:
                f.write(doc)
    ok = all(c["R"] is not None and c["R"] >= 0.99 and c["grads_bitwise_equal"] for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
