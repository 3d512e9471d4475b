"""The planner's predicted peak memory per pipeline stage against a measured training step, side by
side with megatron's theoretical estimate.

    PYTHONPATH=. .venv/bin/python scripts/bench_plan.py [--json] [--cases NAME ...]
    PYTHONPATH=.:scripts .venv/bin/python scripts/bench_plan.py --published-fit [--json]   # step time: the fit
    PYTHONPATH=. .venv/bin/python scripts/bench_plan.py --smoke [--json]   # one case (dense PP2 offload): seconds

Each case is a recipe with flags, run through train.py's own builders on a local world (gloo on CPU):
one warm step, one measured step (scripts/bench/plan). Measured peak per rank = parameters +
DDP gradient buffers + optimizer state (their storages) + the most live activation bytes of the step
(the independent tracker; on CUDA max_memory_allocated); per stage the most loaded rank. Predicted:
megatron_ext.planner, which traces a tiny copy of the model at a smaller shape (widths / 4, sequence
16, vocabulary 64) and scales it to the case's. megatron's estimate (its first stage, its formula,
scripts/estimate_memory.py) is given for the same arguments. The table goes to stderr; --json prints
only {"cases": [...]} on stdout.

--published plans the published H100 runs (megatron_ext.planner.published) as given, one fresh process
per case (the trace included: peaks and throughput); --published-fit runs the step-time fit over the
calibration half of the data points (megatron_ext.planner.published.data_points: the published runs'
tokens/s/GPU and the device record's whole-step times) and predicts every point (no trace, seconds):
each point's role (calibration / held out), measured and predicted figure and error, and each half's
largest |error|.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DENSE = ["--recipe", "recipes/tiny_dense.yaml"]
MOE = ["--recipe", "recipes/tiny_moe.yaml"]
# multi-latent attention (DeepSeek-V3's kind, scaled down) on the MoE recipe, local spec
MLA = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm"]
# offload at the tiny shapes: every saved tensor of 1 KiB or more, small chunks
OFFLOAD = ["--activation-offload-min-tensor-kb", "1", "--activation-offload-chunk-mb", "0.0625"]
ATTN = ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj", *OFFLOAD]
EXPERTS = ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act",
           "router_fc2", *OFFLOAD]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"]
EP2 = ["--expert-model-parallel-size", "2"]
# many experts, DeepSeek-V3's routing (sigmoid scores with expert bias, top-8 of 64 within 4 of 8 groups):
# the planner traces 16 and 32 experts and scales the expert count to 64
MANY = ["--num-experts", "64", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "8", "--moe-router-num-groups", "8",
        "--moe-router-group-topk", "4", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
# context parallelism (torch attention), megatron's comm types; the sequence twice the recipe's
CP2 = ["--context-parallel-size", "2", "--seq-length", "128", "--max-position-embeddings", "128"]
# dropless with zero host syncs: fixed-budget dispatch buffers, experts as grouped GEMMs over them
ZERO_SYNC = ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]

# name: (processes, argv)
CASES = {
    "dense PP1": (1, DENSE),
    "dense PP1 offload": (1, [*DENSE, *ATTN]),
    "dense PP2": (2, [*DENSE, *PP2]),
    "dense PP2 offload": (2, [*DENSE, *PP2, *ATTN]),
    "dense PP2xVPP2": (2, [*DENSE, *VPP2]),
    "dense PP2xVPP2 offload": (2, [*DENSE, *VPP2, *ATTN]),
    "moe PP1": (1, MOE),
    "moe EP2": (2, [*MOE, *EP2]),
    "moe EP2 offload": (2, [*MOE, *EP2, *EXPERTS]),
    "moe PP2": (2, [*MOE, *PP2]),
    "dense TP2 SP": (2, [*DENSE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "mla-moe EP2": (2, [*MOE, *EP2, *MLA]),
    "mla-moe EP2 offload": (2, [*MOE, *EP2, *MLA, *EXPERTS]),
    "moe64 EP2": (2, [*MOE, *EP2, *MANY]),
    "moe64 EP2 offload": (2, [*MOE, *EP2, *MANY, *EXPERTS]),
    "dense CP2 p2p": (2, [*DENSE, *CP2, "--cp-comm-type", "p2p"]),
    "dense CP2 all_gather": (2, [*DENSE, *CP2, "--cp-comm-type", "all_gather"]),
    "dense CP2 a2a": (2, [*DENSE, *CP2, "--cp-comm-type", "a2a"]),
    "dense PP2xCP2 offload": (4, [*DENSE, *PP2, *CP2, *ATTN]),
    "moe EP2 zero-sync": (2, [*MOE, *EP2, *ZERO_SYNC]),
    "moe64 EP2 zero-sync": (2, [*MOE, *EP2, *MANY, *ZERO_SYNC, "--moe-dropless-budget-factor", "1.5"]),
}
SMOKE = "dense PP2 offload"  # both stages, offload's removed bytes: the planner's pipeline and offload models


def run_case(name: str) -> list:
    """Rows (one per pipeline stage) for one case."""
    from megatron_ext.measure.launch import run_world
    from bench.plan import measure

    n, argv = CASES[name]
    results = [r for r in run_world(n, measure, argv=argv) if r["report"]]
    rows = []
    for stage in sorted({r["pp_rank"] for r in results}):
        mine = [r for r in results if r["pp_rank"] == stage]
        worst = max(mine, key=lambda r: sum(r["measured"].values()))
        m, p = worst["measured"], worst["predicted"]
        measured = sum(m.values())
        act_pred = p["activation_peak_bytes"]
        rows.append(dict(
            case=name, stage=stage, predicted_peak_bytes=round(p["peak_bytes"]), measured_peak_bytes=measured,
            megatron_estimate_bytes=round(worst["megatron_estimate"]),
            error=(p["peak_bytes"] - measured) / measured,
            predicted_activation_bytes=round(act_pred), measured_activation_bytes=m["activations"],
            activation_error=(act_pred - m["activations"]) / m["activations"],
            model_state_bytes=m["parameters"] + m["gradients"] + m["optimizer"],
            predicted_model_state_bytes=round(sum(p["components"][k] for k in ("parameters", "gradients", "optimizer"))),
            offloaded_bytes=(worst["offload_stats"] or {}).get("offloaded_bytes", 0),
            peak_at=p["at"],
            measured=m, predicted_components=p["components"],
        ))
    return rows


def _published_names() -> list:
    from megatron_ext.planner.published import CASES as PUBLISHED

    return list(PUBLISHED)


def published_case(name: str) -> dict:
    """The planner on a published run as given (a fresh process per case), beside the published."""
    from bench.plan import plan_published
    from megatron_ext.measure.launch import run_world

    # planned as scripts/plan.py plans (the CUDA-faithful CPU mode is for the measured cases)
    faithful = os.environ.pop("MEGATRON_EXT_CUDA_FAITHFUL", None)
    try:
        row = run_world(1, plan_published, name=name)[0]
    finally:
        if faithful is not None:
            os.environ["MEGATRON_EXT_CUDA_FAITHFUL"] = faithful
    from megatron_ext.planner.published import PUBLISHED_ROLES

    row["role"] = PUBLISHED_ROLES[name]
    row["error"] = row["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"] - 1
    print(f"{name}: peak {row['predicted_peak_gib']:.1f} GiB (published {row['published_peak_gib']}), "
          f"{row['predicted_tokens_per_s_per_gpu']:.0f} tokens/s/GPU (published "
          f"{row['published_tokens_per_s_per_gpu']:.0f})", file=sys.stderr, flush=True)
    return row


def published_fit() -> dict:
    """The step-time fit over the calibration half of the data points (published.data_points: the
    published runs and the device record's whole steps), the constants in use, and every point's
    prediction with them: with its GPU's stored profile (the fit's model) and with the datasheet model
    alone."""
    import arguments

    from megatron_ext.planner import hardware, published

    points = published.data_points(device_steps())
    fit = published.fit(arguments.parse, points)
    rows = _with_datasheet(published.predict(arguments.parse, points),
                           published.predict(arguments.parse, points, profile=None))
    constants = dict(gemm_efficiency=hardware.GEMM_EFFICIENCY, moe_layer_s=hardware.MOE_LAYER_S)
    largest = {role: max(abs(r["error"]) for r in rows if r["role"] == role) for role in published.ROLES}
    return dict(fit=fit, constants=constants,
                constants_are_the_fit=(fit["gemm_efficiency"], fit["moe_layer_s"]) == tuple(constants.values()),
                points=rows, largest_abs_error=largest, offload_loops=offload_loops())


# gpu_check's dense model (scripts/bench/offload.py model_flags, BF16): the local spec, megatron's unfused
# attention, LayerNorm, a GELU MLP, no biases, learned positions, no fused kernels
_RECORD_MODEL = ["--position-embedding-type", "learned_absolute", "--disable-bias-linear", "--bf16",
                 "--tokenizer-type", "NullTokenizer", "--mock-data", "--transformer-impl", "local", "--assume-no-te",
                 "--attention-backend", "unfused", "--micro-batch-size", "1", "--global-batch-size", "1",
                 "--world-size", "1", "--lr", "1e-4", "--train-iters", "1", "--num-workers", "0",
                 "--attention-dropout", "0", "--hidden-dropout", "0", "--no-masked-softmax-fusion",
                 "--no-bias-gelu-fusion", "--no-bias-dropout-fusion"]


def offload_loops() -> list:
    """Not data points: per measured step of a stored profile's "layers" block (the H200's: gpu_check's
    dense model without offload, forward and backward of one micro-batch in the offload section's own
    loop, scripts/bench/offload.py, not a train.py step), the time predicted with that profile and with
    the datasheet model alone, beside the measured one."""
    import arguments

    from megatron_ext.planner import profiles, published

    points = []
    for gpu in profiles.known():
        stored = profiles.load(gpu)
        for r in (stored.get("layers") or {}).get("rows", []):
            argv = ["--num-layers", r["layers"], "--hidden-size", r["hidden"], "--ffn-hidden-size", r["ffn"],
                    "--num-attention-heads", r["heads"], "--seq-length", r["seq"], "--max-position-embeddings", r["seq"],
                    "--vocab-size", r["vocab"], *_RECORD_MODEL]
            points.append(dict(kind="offload loop", name=f"{gpu} {stored['date']} {r['model']} x{r['layers']}", gpu=gpu,
                               argv=[str(a) for a in argv], source=f"megatron_ext/planner/profiles/{gpu}.json",
                               quantity=published.STEP_MS, measured=r["step_ms"], moe=False))
    return _with_datasheet(published.predict(arguments.parse, points),
                           published.predict(arguments.parse, points, profile=None))


def _with_datasheet(rows: list, datasheet: list) -> list:
    """``rows`` (predicted with the stored profiles) with the datasheet model's prediction and error."""
    return [dict(r, predicted_datasheet=d["predicted"], error_datasheet=d["error"]) for r, d in zip(rows, datasheet)]


def device_steps(paths=None) -> list:
    """The device record's data points (published.DEVICE_RECORD): per whole-step row of a gpu_check
    run's throughput section without offload (torch attention and unfused; dense and MoE), in the
    record's order, its flags as the section builds them and its measured forward + backward (median)."""
    from gpu_check_sections import throughput
    from gpu_check_sections.kernel_profile import gpu_kind
    from megatron_ext.planner import published

    points = []
    for path in published.DEVICE_RECORD if paths is None else paths:
        with open(os.path.join(ROOT, path)) as f:
            run = json.load(f)
        gpu = gpu_kind(run["device"])
        for r in run["sections"]["throughput"]["rows"]:
            if r.get("status") != "ok" or r.get("offload"):
                continue
            model = throughput.MODELS["gpu"][r["case"]]
            argv = throughput.run_argv(model, r["layers"], r["attention_backend"], (), 1)
            points.append(dict(kind="device", name=f"{gpu} {run['date']} ({r['case']}) {r['variant']} x{r['layers']}",
                               gpu=gpu, argv=[*argv, "--bf16", "--world-size", "1"], source=path,
                               quantity=published.STEP_MS, measured=r["fwd_bwd_ms"]["median"],
                               moe=bool(model.get("experts"))))
    return points


def points_table(rows: list, head: str = "data point") -> str:
    from megatron_ext.planner.cli import grid
    from megatron_ext.planner import published

    def figure(r, v):
        return f"{v:.0f} tokens/s/GPU" if r["quantity"] == published.THROUGHPUT else f"{v:.1f} ms"

    lines = [(head, "kind", "role", "measured", "predicted", "error", "datasheet model alone")]
    for r in rows:
        kind = f"{r['kind']}, {'MoE' if r['moe'] else 'dense'}"
        lines.append((r["name"], kind, r.get("role", "-"), figure(r, r["measured"]), figure(r, r["predicted"]),
                      f"{100 * r['error']:+.1f}%",
                      f"{figure(r, r['predicted_datasheet'])} ({100 * r['error_datasheet']:+.1f}%)"))
    return grid(lines)


def published_table(rows: list) -> str:
    from megatron_ext.planner.cli import grid

    lines = [("run", "role", "published tokens/s/GPU", "predicted", "error", "attention", "slowest stage")]
    for r in rows:
        lines.append((r["case"], r["role"], f"{r['published_tokens_per_s_per_gpu']:.0f}",
                      f"{r['predicted_tokens_per_s_per_gpu']:.0f}", f"{100 * r['error']:+.1f}%", r.get("attention", "-"),
                      str(r.get("slowest_stage", "-"))))
    return grid(lines)


def table(rows: list) -> str:
    from megatron_ext.planner.cli import grid

    mib = 2**20
    head = ("case", "stage", "predicted MiB", "measured MiB", "error", "act pred MiB", "act meas MiB", "act error",
            "megatron est. MiB")
    lines = [head]
    for r in rows:
        lines.append((r["case"], str(r["stage"]), f"{r['predicted_peak_bytes'] / mib:.2f}",
                      f"{r['measured_peak_bytes'] / mib:.2f}", f"{100 * r['error']:+.1f}%",
                      f"{r['predicted_activation_bytes'] / mib:.2f}", f"{r['measured_activation_bytes'] / mib:.2f}",
                      f"{100 * r['activation_error']:+.1f}%", f"{r['megatron_estimate_bytes'] / mib:.2f}"))
    return grid(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--validate", action="store_true",
                        help="also validate the planner's choice for recipes/cluster/mixtral_8x7b.yaml scaled down "
                        "(scripts/bench/plan.validate_choice); JSON key \"validation\"")
    parser.add_argument("--published", nargs="*", default=None, metavar="CASE",
                        help="also plan the published H100 runs (megatron_ext.planner.published; all without "
                        "names) and compare with their published peak and throughput; JSON key \"published\"")
    parser.add_argument("--published-fit", action="store_true",
                        help="fit the step time's constants over the calibration half of the data points (published "
                        "runs, device steps) and predict every point (no trace); JSON key \"published_fit\"")
    parser.add_argument("--smoke", action="store_true", help=f"seconds: the case {SMOKE!r} only (the suite's run)")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.cases = [SMOKE]
    os.environ.setdefault("MEGATRON_EXT_CUDA_FAITHFUL", "1")
    from megatron_ext import platform

    platform.setup()
    from megatron_ext.planner.cli import logs_to_stderr

    with logs_to_stderr():  # megatron's log records (a case's pipeline layout) off stdout: --json is JSON only
        out = _run(opts)
    if opts.json:
        print(json.dumps(out, indent=1))
    return 0


def _run(opts) -> dict:
    rows = []
    only_published = (opts.published is not None or opts.published_fit) and opts.cases == list(CASES)
    for name in ([] if only_published else opts.cases):
        rows += run_case(name)
        print(f"{name}: done", file=sys.stderr, flush=True)
    if rows:
        print(table(rows), file=sys.stderr)
        worst = max(abs(r["error"]) for r in rows)
        print(f"largest |error| of the peak: {100 * worst:.1f}% over {len(rows)} stage rows", file=sys.stderr)
    out = {"cases": rows}
    if opts.validate:
        from megatron_ext.measure.launch import run_world
        from bench.plan import validate_choice

        v = run_world(2, validate_choice)[0]
        out["validation"] = v
        mib, gib = 2**20, 2**30
        print(f"\nMixtral-8x7B on H100, budget {v['budget_bytes'] / gib:.1f} GiB (predicted peak without offload "
              f"{max(v['plain_peaks']) / gib:.1f} GiB): chosen {' '.join(v['chosen_flags'])}, predicted "
              f"{max(v['chosen_peaks']) / gib:.1f} GiB. Scaled down: budget {v['scaled_budget_bytes'] / mib:.2f} MiB; "
              f"measured {v['measured_with_choice'] / mib:.2f} MiB with the choice, "
              f"{v['measured_without'] / mib:.2f} MiB without offload", file=sys.stderr)
    if opts.published is not None:
        out["published"] = [published_case(name) for name in (opts.published or _published_names())]
        print(published_table(out["published"]), file=sys.stderr)
    if opts.published_fit:
        f = out["published_fit"] = published_fit()
        fit, kept, worst = f["fit"], f["constants"], f["largest_abs_error"]
        print(f"\nfit over the {len(fit['points'])} calibration points: GEMM efficiency {fit['gemm_efficiency']:.2f}, "
              f"{1e3 * fit['moe_layer_s']:.1f} ms per MoE layer and micro-batch; in use (hardware.py): "
              f"{kept['gemm_efficiency']:.2f}, {1e3 * kept['moe_layer_s']:.1f} ms"
              f"{'' if f['constants_are_the_fit'] else ' -- NOT the fit: update hardware.py'}", file=sys.stderr)
        print(points_table(f["points"]), file=sys.stderr)
        print(f"largest |error|: calibration {100 * worst['calibration']:.1f}%, held out "
              f"{100 * worst['held out']:.1f}%", file=sys.stderr)
        print("\nNot data points: the stored profiles' offload-section loops (forward + backward of one micro-batch "
              "in scripts/bench/offload.py's own loop, not a train.py step):", file=sys.stderr)
        print(points_table(f["offload_loops"], "offload-section loop"), file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
