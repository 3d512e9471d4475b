"""What the planner's step time is checked against, and the fit that chooses its two fitted constants
(``hardware.GEMM_EFFICIENCY``, ``hardware.MOE_LAYER_S``) from half of it.

The data points: the published H100 runs below (Megatron-Bridge's performance summary,
docs/performance-summary.md and its archive, 25.09 to 26.04.01 NeMo containers, and its
expert-parallel overlap notes; each case: the run's flags for scripts/plan.py (no recipe), the GPU, the
source, the published figures, None where none is published), then the device record's whole training
steps (``DEVICE_RECORD``; built by scripts/bench_plan.py, which knows gpu_check's models). ``split``
gives each its role: "calibration" (the fit reads it) or "held out" (the fit never reads it).

    PYTHONPATH=.:scripts .venv/bin/python scripts/bench_plan.py --published-fit    # the fit and the table
"""
from __future__ import annotations

GIB = 2**30
_COMMON = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--position-embedding-type", "rope", "--use-distributed-optimizer", "--overlap-grad-reduce",
           "--overlap-param-gather", "--bf16", "--lr", "1e-4", "--train-iters", "10", "--num-workers", "0",
           # Megatron-Bridge's GPTModelProvider default (models/gpt_provider.py): the fused cross-entropy
           "--cross-entropy-loss-fusion"]
# Megatron-Bridge's MoE model bridges (models/qwen/qwen3_moe_bridge.py, models/deepseek/deepseek_v3_bridge.py,
# models/gpt_oss/gpt_oss_bridge.py): grouped GEMM and the fused token permutation
_MOE_FUSED = ["--moe-permute-fusion"]
_QWEN3_30B = ["--num-layers", "48", "--hidden-size", "2048", "--ffn-hidden-size", "6144", "--moe-ffn-hidden-size", "768",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
              "--qk-layernorm", "--num-experts", "128", "--moe-router-topk", "8", "--vocab-size", "151936",
              "--rotary-base", "1000000", "--seq-length", "4096", "--max-position-embeddings", "4096",
              "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-router-load-balancing-type",
              "aux_loss", "--moe-aux-loss-coeff", "1e-3",
              # Megatron-Bridge's Qwen3 performance configs (scripts/performance/configs/qwen/
              # qwen3_llm_pretrain.py set_qwen3_common_configs): gradients reduced in BF16, no recompute
              "--grad-reduce-in-bf16"]
_QWEN3_235B = ["--num-layers", "94", "--hidden-size", "4096", "--ffn-hidden-size", "12288", "--moe-ffn-hidden-size", "1536",
               "--num-attention-heads", "64", "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
               "--qk-layernorm", "--num-experts", "128", "--moe-router-topk", "8", "--vocab-size", "151936",
               "--rotary-base", "1000000", "--seq-length", "4096", "--max-position-embeddings", "4096",
               "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--moe-router-load-balancing-type",
               "aux_loss", "--moe-aux-loss-coeff", "1e-3"]
_LLAMA3_70B = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64",
               "--group-query-attention", "--num-query-groups", "8", "--vocab-size", "128256", "--rotary-base", "500000",
               "--seq-length", "8192", "--max-position-embeddings", "8192"]
# recipes/cluster/deepseek_v3.yaml's model
_DEEPSEEK_V3 = ["--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432", "--num-attention-heads", "128",
                "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
                "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--rotary-scaling-factor", "40",
                "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "129280",
                "--make-vocab-size-divisible-by", "128", "--num-experts", "256", "--moe-layer-freq", "[0]*3+[1]*58",
                "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048", "--moe-router-topk", "8",
                "--moe-router-num-groups", "8", "--moe-router-group-topk", "4", "--moe-router-score-function", "sigmoid",
                "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
                "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
                "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm", "--mtp-num-layers", "1"]
# Megatron-Bridge's performance recipes: FP8 current scaling with FP8 parameters
# (training/mixed_precision.py bf16_with_fp8_current_scaling_mixed: fp8_param_gather; its perf
# precision drops the BF16 first / last layers) and gradients reduced in BF16
# (perf_recipes/_common.py _benchmark_common, _perf_precision)
_FP8_CS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather", "--grad-reduce-in-bf16"]

# recipes/cluster/gpt_oss_120b.yaml's model (scripts/convert.py import of openai/gpt-oss-120b) as
# Megatron-Bridge's GPT-OSS bridge builds it (models/gpt_oss/gpt_oss_bridge.py: grouped GEMM, fused
# permutation and activation)
_GPT_OSS_120B = ["--num-layers", "36", "--hidden-size", "2880", "--ffn-hidden-size", "2880", "--num-attention-heads", "64",
                 "--kv-channels", "64", "--group-query-attention", "--num-query-groups", "8", "--normalization", "RMSNorm",
                 "--norm-epsilon", "1e-5", "--quick-geglu", "--glu-linear-offset", "1.0",
                 "--activation-func-clamp-value", "7.0", "--softmax-type", "learnable", "--seq-length", "4096",
                 "--max-position-embeddings", "131072", "--untie-embeddings-and-output-weights",
                 "--attention-dropout", "0", "--hidden-dropout", "0", "--window-size", "127,0",
                 "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn", "--rotary-base", "150000",
                 "--rotary-scaling-factor", "32.0", "--yarn-original-max-position-embeddings", "4096",
                 "--yarn-beta-fast", "32.0", "--yarn-beta-slow", "1.0", "--vocab-size", "201088",
                 "--make-vocab-size-divisible-by", "128", "--tokenizer-type", "NullTokenizer", "--mock-data",
                 "--num-experts", "128", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "2880",
                 "--moe-router-score-function", "softmax", "--moe-router-load-balancing-type", "aux_loss",
                 "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
                 *_MOE_FUSED, "--bf16", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--lr", "1e-4", "--train-iters", "10",
                 "--num-workers", "0", "--cross-entropy-loss-fusion"]

CASES = {
    # examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh model flags; skills/
    # nemo-mbridge-perf-expert-parallel-overlap: 62.17 GiB peak allocated (rank 0), 41.25 s per step
    # with the plain alltoall dispatcher, no CUDA graphs and no fused permutation
    "qwen3-30b-a3b 16xH100 EP16": dict(
        gpu="h100", argv=[*_QWEN3_30B, *_COMMON, "--expert-model-parallel-size", "16", "--micro-batch-size", "1",
                          "--global-batch-size", "1024", "--world-size", "16"],
        source="Megatron-Bridge EP-overlap notes: BF16, alltoall, no graphs",
        peak_gib=62.17, tokens_per_s_per_gpu=1024 * 4096 / 41.25 / 16),
    # the same notes' benchmark with megatron's expert-parallel overlap (combined 1F1B) on, nothing else
    # changed: 31.31 s per step
    "qwen3-30b-a3b 16xH100 EP16 EP-overlap": dict(
        gpu="h100", argv=[*_QWEN3_30B, *_COMMON, "--expert-model-parallel-size", "16", "--micro-batch-size", "1",
                          "--global-batch-size", "1024", "--world-size", "16", "--overlap-moe-expert-parallel-comm"],
        source="Megatron-Bridge EP-overlap notes: BF16, alltoall, no graphs, EP overlap",
        peak_gib=None, tokens_per_s_per_gpu=1024 * 4096 / 31.31 / 16),
    # performance-summary 25.09, DGX-H100: LLAMA3_70B 64 GPUs FP8-CS TP4 PP8 VP5 MBS1 GBS128 seq 8192
    "llama3-70b 64xH100 TP4 PP8 VP5 fp8": dict(
        gpu="h100", argv=[*_LLAMA3_70B, *_COMMON, *_FP8_CS, "--tensor-model-parallel-size", "4", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                          "--micro-batch-size", "1", "--global-batch-size", "128", "--world-size", "64"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1619.0),
    # performance-summary 25.09, DGX-H100: Qwen3_235B_a22B (tokendrop) 256 GPUs TP2 PP8 VP4 EP32 MBS1
    # GBS2048 (FP8-CS per the 25.11 table's H100 row); 94 layers + embedding + loss in 32 chunks of 3
    "qwen3-235b-a22b 256xH100 TP2 PP8 VP4 EP32 fp8": dict(
        gpu="h100", argv=[*_QWEN3_235B, *_COMMON, *_MOE_FUSED, *_FP8_CS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "3",
                          "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                          "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
                          "--micro-batch-size", "1", "--global-batch-size", "2048", "--world-size", "256"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1204.0),
    # performance-summary 25.09, DGX-H100: DeepSeekV3 (dropless) 1024 GPUs TP2 PP8 VP4 EP64 MBS1 GBS8192,
    # FP8 (blockwise; 338 model TFLOP/s/GPU); 61 layers (3 dense) + one MTP layer in 32 model chunks. The
    # 25.09 launcher (scripts/performance/run_script.py) ran it on H100 with DeepEP (the flex dispatcher,
    # balanced routing), the expert all-to-all overlapped by the combined 1F1B schedule with delayed
    # weight gradients, and no overlapped gradient reduction (apex's gradient-accumulation fusion, which
    # the delayed weight gradients need). Its recompute of the MLA up-projections and the dense MLPs is
    # left out (under 1 % of the step time's model): with mla_up_proj at this scale the trace's scaling
    # of a MoE layer's saved bytes diverges (docs/planner.md, Limits)
    "deepseek-v3 1024xH100 TP2 PP8 VP4 EP64 fp8": dict(
        gpu="h100", argv=[*_DEEPSEEK_V3, *[a for a in _COMMON if a not in ("--overlap-grad-reduce", "--overlap-param-gather")],
                          *_MOE_FUSED, *_FP8_CS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et|(tt|)*30mL",
                          "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
                          "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep",
                          "--moe-router-force-load-balancing", "--overlap-moe-expert-parallel-comm",
                          "--delay-wgrad-compute", "--assume-apex",
                          "--micro-batch-size", "1", "--global-batch-size", "8192", "--world-size", "1024"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1297.0),
    # performance-summary archive, 26.04.01, DGX-H100: GPT OSS 120B 64 GPUs BF16 GBS1280 MBS1 seq 4096 TP1
    # PP4 CP1 EP8: 5824 tokens/s/GPU, 158 model TFLOP/s/GPU (26.02: 5993, 26.04: 5810). Its performance
    # recipe (perf_recipes/gpt_oss/h100/gpt_oss.py, gpt_oss_120b_pretrain_64gpu_h100_bf16_config): selective
    # recompute of the norms and the expert activation, transformer-engine, no sequence parallelism,
    # gradients reduced in BF16 (_perf_precision)
    "gpt-oss-120b 64xH100 PP4 EP8": dict(
        gpu="h100", argv=[*_GPT_OSS_120B, "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                          "--expert-tensor-parallel-size", "1", "--recompute-granularity", "selective",
                          "--recompute-modules", "layernorm", "moe_act", "--grad-reduce-in-bf16",
                          "--micro-batch-size", "1", "--global-batch-size", "1280", "--world-size", "64"],
        source="Megatron-Bridge performance summary 26.04.01, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=5824.0),
}
# gpu_check runs whose throughput section's whole training steps (forward + backward of one step, no
# offload) are data points; scripts/bench_plan.py device_steps builds them
DEVICE_RECORD = ("docs/gpu/2026-11-30-h200-a055a4c-run1.json",)
# what a data point's measured figure is: a published run's tokens/s/GPU, a device step's milliseconds
THROUGHPUT, STEP_MS = "tokens/s/GPU", "step ms"
ROLES = ("calibration", "held out")
# the fit's grids: GEMM efficiency (fraction of the precision's peak), seconds per MoE layer and micro-batch
GEMM_EFFICIENCY_GRID = tuple(round(0.30 + 0.01 * i, 2) for i in range(66))
MOE_LAYER_S_GRID = tuple(round(1e-4 * i, 4) for i in range(81))


def published_points() -> list:
    """The published runs as data points, in ``CASES``' order."""
    return [dict(kind="published", name=name, gpu=c["gpu"], argv=c["argv"], source=c["source"], quantity=THROUGHPUT,
                 measured=c["tokens_per_s_per_gpu"], moe="--num-experts" in c["argv"]) for name, c in CASES.items()]


def split(points: list) -> list:
    """The points with their roles, by their order alone (no point's error chooses its role): within
    each kind (published runs, device steps), in the order listed, the first is calibration, the
    second held out, and so on alternately."""
    seen: dict = {}
    out = []
    for p in points:
        i = seen[p["kind"]] = seen.get(p["kind"], -1) + 1
        out.append(dict(p, role=ROLES[i % 2]))
    return out


def data_points(device_steps: list) -> list:
    """What the planner knows, each point with its role: the published runs, then ``device_steps``
    (kind "device", quantity ``STEP_MS``: the device record's whole steps, in the record's order)."""
    return split([*published_points(), *device_steps])


PUBLISHED_ROLES = {p["name"]: p["role"] for p in split(published_points())}


def parse(argv: list, parse_run, gpu: str = "h100"):
    """A case's arguments as scripts/plan.py validates them for the GPU cluster (``parse_run``: the
    entry point's argument table, ``arguments.parse``)."""
    from megatron_ext.planner import cli

    return cli.parse([*argv, "--gpu", gpu], "--", parse_run)[1]


def _step_time(args, gpu: str, profile, gemm_efficiency=None, moe_layer_s=None) -> dict:
    """steptime.step_time of the parsed run as planned: no trace (no step-time term depends on the
    activations) and no data-parallel term (the published runs overlap their gradient reduction; the
    device steps run on one GPU)."""
    from megatron_ext.planner import memory, profiles, steptime
    from megatron_ext.planner.run import resolved_recompute

    layout = memory.Layout.from_args(args)
    dev = profiles.device(gpu, profile, gemm_efficiency=gemm_efficiency, moe_layer_s=moe_layer_s)
    return steptime.step_time(args, layout, [dict(components=dict(parameters=0.0))], [0.0], dev, dev.host_link,
                              resolved_recompute(args))


def _predicted(point: dict, args, layout, step_s: float) -> float:
    """The point's quantity predicted from a step of ``step_s`` seconds."""
    if point["quantity"] == THROUGHPUT:
        return args.global_batch_size * args.seq_length / step_s / layout.world
    return 1e3 * step_s


def predict(parse_run, points: list, profile="stored", gemm_efficiency=None, moe_layer_s=None) -> list:
    """Per point: the predicted figure and its error (predicted / measured - 1) on the model the planner
    uses for the point's GPU (``profile="stored"``: its stored profile, the datasheet model where none
    is stored; None: the datasheet model alone)."""
    from megatron_ext.planner import memory

    rows = []
    for p in points:
        args = parse(p["argv"], parse_run, p["gpu"])
        t = _step_time(args, p["gpu"], profile, gemm_efficiency, moe_layer_s)
        predicted = _predicted(p, args, memory.Layout.from_args(args), t["step_time_s"])
        rows.append(dict({k: v for k, v in p.items() if k != "argv"}, predicted=predicted,
                         error=predicted / p["measured"] - 1, step_time_s=t["step_time_s"], attention=t["attention"],
                         kernels=t["kernels"], slowest_stage=t["slowest_stage"]))
    return rows


def throughput(parse_case, names=None, gemm_efficiency=None, moe_layer_s=None, profile="stored") -> list:
    """Per published run: the predicted step time as given and tokens/s/GPU beside the published
    figure (as ``predict``). ``parse_case``: argv -> parsed arguments."""
    rows = []
    for name in names or CASES:
        c = CASES[name]
        args = parse_case(c["argv"])
        t = _step_time(args, c["gpu"], profile, gemm_efficiency, moe_layer_s)
        rows.append(dict(case=name, role=PUBLISHED_ROLES[name], gpu=c["gpu"], source=c["source"],
                         published_tokens_per_s_per_gpu=c["tokens_per_s_per_gpu"],
                         predicted_tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"],
                         error=t["tokens_per_s_per_gpu"] / c["tokens_per_s_per_gpu"] - 1,
                         step_time_s=t["step_time_s"], model_tflops_per_gpu=t["model_tflops_per_gpu"],
                         attention=t["attention"], kernels=t["kernels"], slowest_stage=t["slowest_stage"],
                         time={k: v for k, v in t.items() if k.endswith("_s")}))
    return rows


def fit(parse_run, points: list) -> dict:
    """The two fitted constants: the (GEMM efficiency, seconds per MoE layer and micro-batch) of the
    grids with the smallest largest |error| over the calibration points (then the smallest sum of
    squared errors), each point on the model ``predict`` uses for it (its GPU's stored profile).
    Reads only the points whose role is "calibration"."""
    from megatron_ext.planner import memory, profiles, steptime
    from megatron_ext.planner.run import resolved_recompute

    calibration = [p for p in points if p["role"] == "calibration"]
    runs = []
    for p in calibration:
        args = parse(p["argv"], parse_run, p["gpu"])
        runs.append((p, args, memory.Layout.from_args(args)))
    best = None
    for eff in GEMM_EFFICIENCY_GRID:
        # the stages' times without the MoE fixed time, which adds moe_layers x MOE_LAYER_S to each
        per_point = [(p, args, layout, steptime.stage_times(
            args, layout, profiles.device(p["gpu"], "stored", gemm_efficiency=eff, moe_layer_s=0.0),
            resolved_recompute(args))) for p, args, layout in runs]
        for moe_s in MOE_LAYER_S_GRID:
            errors = [_predicted(p, args, layout, _step_s(layout, stages, moe_s)) / p["measured"] - 1
                      for p, args, layout, stages in per_point]
            key = (round(max(abs(e) for e in errors), 9), sum(e * e for e in errors))
            if best is None or key < best[0]:
                best = (key, eff, moe_s, errors)
    (worst, _), eff, moe_s, errors = best
    names = [p["name"] for p in calibration]
    return dict(gemm_efficiency=eff, moe_layer_s=moe_s, largest_abs_error=worst, errors=dict(zip(names, errors)),
                points=names)


def _step_s(layout, stages: list, moe_s: float) -> float:
    """Seconds per step of the stages' times plus ``moe_s`` per MoE layer and micro-batch, scheduled as
    ``steptime.step_time`` schedules them (without its data-parallel and offload terms, as
    ``_step_time`` has them)."""
    from megatron_ext.planner import steptime

    totals = [s["total_s"] + s["moe_layers"] * moe_s for s in stages]
    return layout.microbatches * max(totals) + steptime.bubble_s(layout, totals)
