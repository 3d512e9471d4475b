"""The model zoo, as data: the architectures people train with megatron-core, each with the model
flags of its published configuration, scaled down to 2 layers, hidden 64, 4 heads and 8 experts
(published sizes in the comments). Everything else about the architecture (attention kind, norms,
activation, routing, shared experts, layer patterns, MTP) is as published.

Each case runs on 2 processes: TP2 with sequence parallelism; MoE cases also EP2 (expert-TP 1); two
micro-batches a step (the overlapped 1F1B pairs them), two steps. The pipeline cases take four.
`features` are every megatron_ext feature the architecture can use; tests/training/test_zoo.py
trains each case plain and with them on and requires identical losses, grad norms and weights.
"""
from __future__ import annotations

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234", "--init-method-std", "0.02", "--bf16",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--transformer-impl", "local",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--make-vocab-size-divisible-by", "80",
    "--num-workers", "0", "--log-interval", "1", "--untie-embeddings-and-output-weights",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "2",
]
MOE_PARALLEL = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-router-dtype", "fp32"]
ATTENTION_MODULES = ["core_attention", "qkv_linear", "attn_proj"]
EXPERT_MODULES = ["router_fc1", "router_fc2", "moe_act"]

# The model flags below follow Megatron-LM's own configurations of these models
# (examples/post_training/modelopt/conf/<org>/<model>.sh, examples/gptoss/02_train.sh); sizes scaled down.
_COMMON = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
           "--no-rope-fusion", "--no-masked-softmax-fusion"]
# multi-latent attention as DeepSeek-V3 / Kimi-K2 configure it (q_lora 1536, kv_lora 512, qk 128 + rope 64,
# v 128, qk-layernorm = the latent norms; yarn rope with mscale 1.0 / 1.0), scaled down
_MLA = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm",
        "--mscale", "1.0", "--mscale-all-dim", "1.0"]
# DeepSeek-V3's MoE: sigmoid scores with an expert bias, pre-softmax, a sequence-level aux loss, one
# shared expert overlapped with the dispatch, dense first layers
_DEEPSEEK_MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                 "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap",
                 "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "1e-3", "--moe-router-pre-softmax",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
                 "--moe-token-dispatcher-type", "alltoall", "--moe-token-drop-policy", "probs",
                 "--moe-layer-freq", "([0]+[1]*1)", "--ffn-hidden-size", "128"]
_QWEN3 = ["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm",
          "--rotary-percent", "1.0", "--rotary-base", "1000000", "--no-bias-swiglu-fusion"]
_AUX_LOSS_MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                 "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
                 "--moe-token-dispatcher-type", "alltoall"]

ZOO = {
    "deepseek_v3": dict(  # DeepSeek-V3/R1: 61 layers (3 dense), hidden 7168, 128 heads, 256 experts top-8 in
        # 8 groups (top-4 groups), scaled 2.5; one MTP layer
        argv=[*_COMMON, *_MLA, *_DEEPSEEK_MOE, "--rotary-base", "10000", "--rotary-scaling-factor", "40",
              "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
              "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"],
        moe=True, shared_experts=True),
    "deepseek_v2_lite": dict(  # DeepSeek-V2-Lite: 27 layers (1 dense), hidden 2048, 16 heads, no query LoRA,
        # 64 experts top-6 (softmax), 2 shared, mscale 0.707
        argv=[*_COMMON, "--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "16",
              "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--kv-channels", "16", "--qk-layernorm",
              "--rotary-base", "10000", "--rotary-scaling-factor", "40", "--mscale", "0.707", "--mscale-all-dim", "0.707",
              "--norm-epsilon", "1e-6", "--attention-softmax-in-fp32",
              "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
              "--moe-shared-expert-intermediate-size", "64", "--moe-router-score-function", "softmax",
              "--moe-router-topk-scaling-factor", "1.0", "--moe-router-pre-softmax",
              "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
              "--moe-token-dispatcher-type", "alltoall", "--moe-token-drop-policy", "probs",
              "--moe-layer-freq", "([0]+[1]*1)", "--ffn-hidden-size", "128"],
        moe=True, shared_experts=True),
    "kimi_k2": dict(  # Kimi-K2: 61 layers (1 dense), hidden 7168, 64 heads, 384 experts top-8 (one group),
        # scaled 2.827, yarn factor 32
        argv=[*_COMMON, *_MLA, *_DEEPSEEK_MOE, "--rotary-base", "50000", "--rotary-scaling-factor", "32",
              "--moe-router-topk-scaling-factor", "2.827"],
        moe=True, shared_experts=True),
    "qwen3": dict(  # Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 KV groups, head dim 128
        argv=[*_COMMON, *_QWEN3, "--ffn-hidden-size", "192"],
        moe=False),
    "qwen3_moe": dict(  # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads / 4 KV groups, 128 experts top-8
        argv=[*_COMMON, *_QWEN3, "--ffn-hidden-size", "192", *_AUX_LOSS_MOE],
        moe=True),
    "gpt_oss": dict(  # gpt-oss-20b: 24 layers, hidden 2880, 64 heads / 8 KV groups, 32 experts top-4; biases,
        # GLU of quick-GELU with offset 1 clamped at 7, sliding window 128 on every other layer, learnable
        # softmax sinks; yarn rope (factor 32 from 4096 positions, beta 32 / 1)
        argv=["--normalization", "RMSNorm", "--no-rope-fusion", "--no-masked-softmax-fusion",
              "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16", "--quick-geglu",
              "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0", "--softmax-type", "learnable",
              "--window-size", "7,0", "--window-attn-skip-freq", "2", "--position-embedding-type", "yarn",
              "--rotary-base", "150000", "--rotary-scaling-factor", "32", "--yarn-original-max-position-embeddings",
              "16", "--yarn-beta-fast", "32", "--yarn-beta-slow", "1", "--no-bias-gelu-fusion",
              "--no-bias-dropout-fusion", "--ffn-hidden-size", "64", *_AUX_LOSS_MOE, "--moe-z-loss-coeff", "1e-3"],
        moe=True, expert_bias=True),
    "llama3": dict(  # Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 KV groups, rope 500000 with llama-3.1 scaling
        argv=[*_COMMON, "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "224",
              "--rotary-base", "500000", "--use-rope-scaling"],
        moe=False),
    "llama4": dict(  # Llama-4-Scout: 48 layers, hidden 5120, 40 heads / 8 KV groups, 16 experts top-1 with
        # sigmoid scores applied to the expert input and a shared expert, interleaved rope scaled by 8,
        # no rope on every 4th layer (here the 2nd), the L2 query/key norm on the rope layers
        argv=[*_COMMON, "--group-query-attention", "--num-query-groups", "2", "--qk-l2-norm", "--no-rope-freq", "[0,1]",
              "--qk-norm-skip-nope-layers", "--ffn-hidden-size",
              "128", "--rotary-interleaved", "--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor",
              "8.0", "--no-bias-swiglu-fusion", "--num-experts", "8", "--moe-router-topk", "1",
              "--moe-router-score-function", "sigmoid", "--moe-apply-probs-on-input", "--moe-router-topk-scaling-factor", "1.0",
              "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
              "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
              "--moe-token-dispatcher-type", "alltoall", "--moe-token-drop-policy", "probs"],
        moe=True, shared_experts=True),
    "nemotron": dict(  # Nemotron-Mini-4B: 32 layers, hidden 3072, 24 heads / 8 KV groups, squared ReLU,
        # zero-centred LayerNorm (--apply-layernorm-1p), rope on half of each head
        argv=["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "192",
              "--normalization", "LayerNorm", "--apply-layernorm-1p", "--squared-relu", "--disable-bias-linear",
              "--use-rotary-position-embeddings", "--rotary-percent", "0.5", "--no-rope-fusion", "--no-position-embedding",
              "--no-masked-softmax-fusion", "--rotary-base", "10000"],
        moe=False),
}


# LoRA adapters (megatron_ext/lora/) on every attention and MLP linear the architecture has, the routed
# and shared experts' and the router's (tests/lora/test_zoo.py trains the pipeline cases with them)
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "all-linear"]


def plain_argv(name: str) -> list[str]:
    case = ZOO[name]
    return [*BASE, *case["argv"], *(MOE_PARALLEL if case["moe"] else [])]


def offload_modules(name: str) -> list[str]:
    case = ZOO[name]
    modules = list(ATTENTION_MODULES)
    if not case["moe"] or "--moe-layer-freq" in case["argv"]:  # a dense layer's MLP
        modules.append("dense_mlp")
    if case["moe"]:
        modules += EXPERT_MODULES + (["shared_experts"] if case.get("shared_experts") else [])
    return modules


def features_argv(name: str) -> list[str]:
    """Every megatron_ext feature the architecture can use, on."""
    extra = ["--activation-offload-modules", *offload_modules(name), "--activation-offload-min-tensor-kb", "0",
             "--overlap-tp-comm-1f1b"]
    if ZOO[name]["moe"]:
        extra.append("--moe-sync-free-dispatcher")
    return plain_argv(name) + extra


def zero_sync_argv(name: str) -> list[str]:
    """Every feature, with the MoE layers in the zero-sync dropless mode (fixed-budget dispatch,
    grouped experts over device offsets)."""
    return features_argv(name) + ["--moe-zero-sync-dropless"]


# Features next to megatron's own memory savers and DeepSeek-V3's MTP: (architecture, extra flags for
# both runs, offload modules). A recomputed module saves nothing to offload (offload refuses it).
COMBINATIONS = {
    "recompute_activations": ("deepseek_v3", ["--recompute-activations"], ["qkv_linear", "attn_proj", *EXPERT_MODULES]),
    "moe_layer_recompute": ("deepseek_v3", ["--moe-layer-recompute"], ["qkv_linear", "attn_proj"]),
    "mtp_two_layers": ("kimi_k2", ["--mtp-num-layers", "2"], [*ATTENTION_MODULES, *EXPERT_MODULES, "shared_experts"]),
}


def combination_argv(name: str, features: bool) -> list[str]:
    arch, extra, modules = COMBINATIONS[name]
    if not features:
        return plain_argv(arch) + extra
    argv = features_argv(arch) + extra
    i = argv.index("--activation-offload-modules")
    j = argv.index("--activation-offload-min-tensor-kb")
    return argv[: i + 1] + modules + argv[j:]


# Under pipeline parallelism with virtual stages: 4 processes, TP2 + SP x PP2, 2 virtual stages per
# rank (4 layers, one per virtual stage), EP2 (expert-TP 1). Three of Megatron-LM's
# examples/post_training/modelopt/conf/ MoE models, scaled down as above, with their own layer
# patterns and recompute flags: (zoo architecture, flags of both runs).
PP_VPP = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
          "--world-size", "4"]
PP_CASES = {
    # DeepSeek-R1: DeepSeek-V3's architecture (MLA, group-limited routing, shared expert overlapped
    # with the dispatch, MTP), first layer dense, selective recompute + MoE-layer recompute
    "deepseek_r1": ("deepseek_v3", ["--moe-layer-freq", "([0]+[1]*3)", "--recompute-activations",
                                    "--moe-layer-recompute"]),
    # Llama-4-Maverick: dense and MoE layers interleaved, no RoPE on every 4th layer, MoE-layer recompute
    "llama4_maverick": ("llama4", ["--moe-layer-freq", "([0,1]*2)", "--no-rope-freq", "4", "--moe-layer-recompute"]),
    # Qwen3-235B-A22B: Qwen3-MoE, MoE-layer recompute
    "qwen3_235b": ("qwen3_moe", ["--moe-layer-recompute"]),
}


def pp_offload_modules(case: str) -> list[str]:
    """offload_modules of the architecture less what the recipe's recompute re-runs (offload
    refuses those): --recompute-activations re-runs core attention; --moe-layer-recompute makes
    megatron's granularity selective with its default modules (core_attn) plus the MoE layer."""
    arch, extra = PP_CASES[case]
    drop = set()
    if "--recompute-activations" in extra or "--moe-layer-recompute" in extra:
        drop.add("core_attention")
    if "--moe-layer-recompute" in extra:
        drop |= {"router_fc1", "router_fc2", "moe_act", "shared_experts"}
    return [m for m in offload_modules(arch) if m not in drop]


def pp_argv(case: str, features: bool) -> list[str]:
    """`case` under PP2 x VPP2, plain or with every feature on: offload of what the recompute leaves
    saved, the sync-free + zero-sync dispatcher, the overlapped 1F1B."""
    arch, extra = PP_CASES[case]
    argv = zero_sync_argv(arch) if features else plain_argv(arch)
    if features:
        i = argv.index("--activation-offload-modules")
        j = argv.index("--activation-offload-min-tensor-kb")
        argv = argv[: i + 1] + pp_offload_modules(case) + argv[j:]
    if "--moe-layer-freq" in argv and "--moe-layer-freq" in extra:
        k = argv.index("--moe-layer-freq")
        argv = argv[:k] + argv[k + 2:]
    return argv + PP_VPP + extra + ["--train-iters", "1", "--global-batch-size", "4"]
