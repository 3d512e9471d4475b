"""Activation offload benchmark: per PP stage, peak device bytes with and without offload, the
theoretical saving from shapes and schedule, R = saved / theoretical, whether loss and every gradient
are bit-identical, and the compute-stream time spent waiting for copies (exposed_copy_s).

    PYTHONPATH=. .venv/bin/python scripts/bench_offload.py [--json [FILE]] [--png docs/offload_timeline.png]
    PYTHONPATH=. .venv/bin/python scripts/bench_offload.py --smoke [--json]   # seconds: the suite's run

Cases: PP=1, PP=2 1F1B, PP=2 x VPP=2, and PP=2 x CP=2 (torch attention) once per CP comm type (not
in --smoke); dense and MoE (all seven modules offloaded for MoE); every rank. On CPU each case runs in
the CUDA-faithful mode under two host links of its copy engine: "fast" (one layer's copy takes 0.1x
that layer's measured forward time) and "slow" (1.5x); peak bytes come
from the independent tracker (megatron_ext.measure.memtrack.LiveBytesTracker). On CUDA each case runs
once on the real link, peak bytes from torch.cuda.max_memory_allocated (reset per measured step);
--overhead adds step times from CUDA events. R is computed for the local layer spec only (the theory
does not model the transformer-engine spec). The table goes to stderr; --json alone prints pure JSON
on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DENSE = ["qkv_linear", "core_attention", "attn_proj"]
MOE = ["qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act", "router_fc2", "shared_experts"]
MODEL = dict(layers=8, hidden=64, heads=4, seq=64, mbs=2, vocab=8192, ffn=256, experts=4, topk=2, moe_ffn=128,
             microbatches=4)
SCHEDULES = {"PP=1": dict(pp=1), "PP=2 1F1B": dict(pp=2), "PP=2xVPP=2": dict(pp=2, vpp=2)}
# context parallelism under 1F1B (torch attention: CP runs no other), once per comm type, at 4 x the
# sequence: torch attention keeps no s x s probabilities, and at 2 x the first stage's peak with
# offload is the embedding's gradient, which offload cannot lower (docs/offload.md "Limits")
CP = dict(pp=2, cp=2, attention="sdpa", seq=4 * MODEL["seq"])
SCHEDULES.update({f"PP=2xCP=2 {comm}": dict(CP, cp_comm_type=comm) for comm in ("p2p", "all_gather", "a2a")})
OFFLOAD = dict(pool_mb=256.0, chunk_mb=1 / 16, prefetch_depth=1, min_tensor_kb=1.0, debug=False,
               cross_pass_prefetch="after-forward")
LINKS = {"fast": "x0.1", "slow": "x1.5"}  # one layer's copy time / that layer's forward time
# --smoke: the schedules without CP and both models at the full size, the fast link alone, one
# micro-batch per pipeline stage; no timeline (CP's cases: tests/offload/test_context_parallel.py)
SMOKE = dict(microbatches=2, links={"fast": "x0.1"}, schedules=[s for s in SCHEDULES if "cp" not in SCHEDULES[s]])
# the vocabulary (8192 against hidden 64) puts the last stage's peak at the logits gradient, where only
# the last layer of the pass is resident (offload/theory.py); other stages peak in a layer's backward
PEAK = "loss_backward"


def run_schedule(schedule: str, timeline_case: str, offload=None, smoke: bool = False) -> list:
    """Job (every rank): both models under one schedule, rows in (model, link) order."""
    rows = []
    for model in ("dense", "moe"):
        rows += run_case(schedule, model, timeline=timeline_case == f"{schedule}:{model}", offload=offload,
                         smoke=smoke)
    return rows


def run_case(schedule: str, model: str, timeline: bool = False, offload=None, links=None, smoke: bool = False):
    """Offload off vs on, on the same model and data, once per link."""
    import torch

    from bench import offload as bench
    from megatron_ext.offload import theory

    moe = model == "moe"
    kw = dict(MODEL, **SCHEDULES[schedule], model=model, shared=128 if moe else 0)
    offload = offload or OFFLOAD
    links = links if links is not None else ({"device": None} if torch.cuda.is_available() else LINKS)
    if smoke:
        kw["microbatches"] = SMOKE["microbatches"]
        links = links if torch.cuda.is_available() else SMOKE["links"]
    r = bench.compare(modules=MOE if moe else DENSE, steps=2, offload_kw=offload, track=True, timeline=timeline,
                      links=list(links.values()), peak=PEAK, **kw)
    pp, vpp = kw["pp"], kw.get("vpp")
    rows = []
    for name, run in zip(links, r["runs"]):
        s = run["stats"]
        row = dict(
            schedule=schedule, model=model, pp_rank=r["pp_rank"], spec="local", attention=kw.get("attention", "unfused"),
            cp=kw.get("cp", 1), cp_rank=r["cp_rank"], link=name,
            link_gbps=run["link_gbps"], copy_to_compute=run["copy_to_compute"],
            peak_off_bytes=r["peak_off"], peak_on_bytes=run["peak_on"], theoretical_bytes=r["theoretical_bytes"],
            saved_bytes=run["saved_bytes"], R=run["R"],
            grads_bitwise_equal=bool(run["grads_equal"] and run["losses_equal"] and not run["nan_grads"]),
            **{k: run[k] if run[k] is not None else "not measured on GPU"
               for k in ("exposed_copy_s", "exposed_d2h_s", "exposed_h2d_s")},
            step_s=run["step_s"], layer_forward_s=r["layer_forward_s"], group_bytes=r["theory_group_bytes"],
            inflight_passes=theory.inflight_passes(pp, vpp, r["pp_rank"], kw["microbatches"]),
            layers_per_chunk=kw["layers"] // (pp * (vpp or 1)), offloaded_bytes=s["offloaded_bytes"],
            kept_last_bytes=s["kept_last_bytes"], served_in_flight_bytes=s["served_in_flight_bytes"],
            prefetched_groups=s["prefetched_groups"], on_demand_groups=s["on_demand_groups"],
        )
        if timeline:
            row["timeline_off"], row["timeline_on"] = r["timeline_off"], run["timeline_on"]
        rows.append(row)
    return rows


def time_steps(**kw):
    """Job: CUDA step time and peaks with offload off and on (scripts/bench/offload)."""
    from bench import offload as bench

    return bench.time_steps(**kw)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["pp_rank"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 3.6), squeeze=False)
    for ax, rank in zip(axes[0], ranks):
        mine = [r for r in rows if r["pp_rank"] == rank]
        curves = [("offload off", mine[0]["timeline_off"])]
        curves += [(f"offload on, {r['link']} link (R={r['R']:.3f})", r["timeline_on"]) for r in mine]
        for label, ys in curves:
            xs = [i / max(1, len(ys) - 1) for i in range(len(ys))]
            ax.plot(xs, [y / 2**20 for y in ys], label=label, lw=1)
        ax.set_title(f"{mine[0]['schedule']} {mine[0]['model']}, PP rank {rank}", fontsize=9)
        ax.set_xlabel("fraction of the step's ops (forward+backward)")
        ax.set_ylabel("device-resident activation MiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def table(doc, out) -> None:
    print(f"device: {doc['device']}", file=out)
    hdr = (f"{'schedule':<20} {'model':<6} {'rank':>5} {'link':<5} {'GB/s':>7} {'copy/fwd':>8} {'peak off MiB':>12} "
           f"{'peak on MiB':>12} {'theory MiB':>10} {'saved MiB':>10} {'R':>7} {'bitwise':>8} {'exposed s':>9} "
           f"{'step s':>7}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for c in doc["cases"]:
        rank = str(c["pp_rank"]) if c["cp"] == 1 else f"{c['pp_rank']}/{c['cp_rank']}"  # PP rank / CP rank
        print(f"{c['schedule']:<20} {c['model']:<6} {rank:>5} {c['link']:<5} {_fmt(c['link_gbps'], '7.4f'):>7} "
              f"{_fmt(c['copy_to_compute'], '8.2f'):>8} {c['peak_off_bytes'] / 2**20:>12.3f} "
              f"{c['peak_on_bytes'] / 2**20:>12.3f} {c['theoretical_bytes'] / 2**20:>10.3f} "
              f"{c['saved_bytes'] / 2**20:>10.3f} {c['R']:>7.4f} {str(c['grads_bitwise_equal']):>8} "
              f"{_fmt(c['exposed_copy_s'], '9.4f'):>9} {c['step_s']:>7.3f}", file=out)
    print(f"overhead: {doc['overhead']}", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="write JSON to FILE, or with no FILE print only JSON on stdout (the table goes to stderr)")
    ap.add_argument("--png", default=None, help="the timeline's picture (default docs/offload_timeline.png; none "
                    "with --smoke)")
    ap.add_argument("--timeline-case", default="PP=2xVPP=2:moe")
    ap.add_argument("--overhead", action="store_true",
                    help="also time steps with/without offload at a GPU-sized shape (GPU only; on CPU: "
                    "'not measured on GPU')")
    ap.add_argument("--overhead-shape", default="layers=8,hidden=4096,heads=32,seq=4096,ffn=16384",
                    help="model of the --overhead run (comma-separated key=value)")
    ap.add_argument("--cross-pass-prefetch", choices=("off", "after-forward", "always"), default="after-forward",
                    help="as --activation-offload-cross-pass-prefetch")
    ap.add_argument("--smoke", action="store_true", help="seconds: every case, 2 micro-batches, the fast link "
                    "alone, no timeline unless --png is given")
    a = ap.parse_args(argv)
    if a.png is None and not a.smoke:
        a.png = os.path.join(ROOT, "docs", "offload_timeline.png")
    if a.png is None:
        a.timeline_case = ""  # no timeline recorded
    OFFLOAD["cross_pass_prefetch"] = a.cross_pass_prefetch

    import torch

    from megatron_ext.measure.launch import run_world
    from megatron_ext.platform import faithful

    cuda = torch.cuda.is_available()
    if not cuda:  # the copy engine of the CUDA-faithful CPU mode; the workers inherit it
        os.environ[faithful.ENV] = "1"
    device = torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores, gloo; CUDA-faithful copy engine)"
    cases = []
    for schedule, extra in SCHEDULES.items():
        if a.smoke and schedule not in SMOKE["schedules"]:
            continue
        per_rank = run_world(extra["pp"] * extra.get("cp", 1), run_schedule, timeout=3600, schedule=schedule,
                             timeline_case=a.timeline_case, offload=OFFLOAD, smoke=a.smoke)
        for model in ("dense", "moe"):  # rows ordered (model, link, rank)
            rows = [row for rank_rows in per_rank for row in rank_rows if row["model"] == model]
            cases += sorted(rows, key=lambda r: (r["link"] != "fast", r["pp_rank"], r["cp_rank"]))
    overhead = {"step_time": "not measured on GPU"}
    if a.overhead and cuda:
        shape = {k: int(v) for k, v in (kv.split("=") for kv in a.overhead_shape.split(","))}
        big = dict(MODEL, mbs=1, vocab=32000, microbatches=4, dtype="bfloat16", **shape)
        overhead = run_world(1, time_steps, timeout=3600, modules=DENSE, offload_kw=dict(
            OFFLOAD, chunk_mb=4.0, min_tensor_kb=64.0, pool_mb=16384.0), **big)[0]
    timelines = [c for c in cases if "timeline_on" in c]
    if timelines and a.png:
        plot(timelines, a.png)
    for c in cases:
        c.pop("timeline_on", None), c.pop("timeline_off", None)

    doc = {"device": device, "cases": cases, "overhead": overhead}
    table(doc, sys.stderr)
    if a.png and timelines:
        print(f"timeline: {a.png}", file=sys.stderr)
    if a.json == "-":
        print(json.dumps(doc, indent=1))
    elif a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(doc, indent=1) + "\n")
    ok = all(c["R"] is not None and c["R"] >= 0.99 and c["grads_bitwise_equal"] for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
