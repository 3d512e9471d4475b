"""The model zoo, as data: the architectures people train with megatron-core, each with the model
flags of its published configuration, scaled down to 2 layers, hidden 64, 4 heads and 8 experts
(published sizes in the comments). Everything else about the architecture (attention kind, norms,
activation, routing, shared experts, layer patterns, MTP) is as published.

Each case runs on 2 processes: TP2 with sequence parallelism; MoE cases also EP2 (expert-TP 1).
`features` are every megatron_ext feature the architecture can use; tests/training/test_zoo.py
trains each case plain and with them on and requires identical losses, grad norms and weights.
"""
from __future__ import annotations

BASE = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234", "--init-method-std", "0.02",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--transformer-impl", "local",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--make-vocab-size-divisible-by", "80",
    "--num-workers", "0", "--log-interval", "1", "--untie-embeddings-and-output-weights",
    "--tensor-model-parallel-size", "2", "--sequence-parallel", "--world-size", "2",
]
MOE_PARALLEL = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-router-dtype", "fp32"]
ATTENTION_MODULES = ["core_attention", "qkv_linear", "attn_proj"]
EXPERT_MODULES = ["router_fc1", "router_fc2", "moe_act"]

# multi-latent attention as DeepSeek-V3 / Kimi-K2 configure it (q_lora 1536, kv_lora 512, qk 128 + rope 64,
# v 128; yarn rope, factor 40, mscale 1.0 / 1.0), scaled down
_MLA = ["--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32", "--qk-head-dim", "16",
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--rotary-scaling-factor", "40",
        "--mscale", "1.0", "--mscale-all-dim", "1.0", "--rotary-base", "10000",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"]
# DeepSeek-V3's MoE: 256 routed experts top-8 in 8 groups (top-4 groups), sigmoid scores with an expert
# bias, scores scaled by 2.5, a sequence-level aux loss, one shared expert, the first 3 layers dense
_DEEPSEEK_MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                 "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                 "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
                 "--moe-token-dispatcher-type", "alltoall", "--ffn-hidden-size", "128"]

ZOO = {
    "deepseek_v3": dict(  # 61 layers (3 dense), hidden 7168, 128 heads, MTP 1 layer
        argv=[*_MLA, *_DEEPSEEK_MOE, "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
              "--moe-router-topk-scaling-factor", "2.5", "--moe-layer-freq", "([0]+[1]*1)", "--mtp-num-layers", "1",
              "--mtp-loss-scaling-factor", "0.1"],
        moe=True, shared_experts=True),
    "kimi_k2": dict(  # 61 layers (1 dense), hidden 7168, 64 heads, 384 experts top-8 in one group, scaled 2.827
        argv=[*_MLA, *_DEEPSEEK_MOE, "--moe-router-num-groups", "1", "--moe-router-group-topk", "1",
              "--moe-router-topk-scaling-factor", "2.827"],
        moe=True, shared_experts=True),
    "qwen3": dict(  # Qwen3-8B: 36 layers, hidden 4096, 32 heads, 8 KV groups, head dim 128, qk-layernorm
        argv=["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm",
              "--ffn-hidden-size", "192", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
              "--position-embedding-type", "rope", "--rotary-base", "1000000"],
        moe=False),
    "qwen3_moe": dict(  # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads / 4 KV groups, 128 experts top-8
        argv=["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "32", "--qk-layernorm",
              "--ffn-hidden-size", "192", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
              "--position-embedding-type", "rope", "--rotary-base", "1000000",
              "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
              "--moe-token-dispatcher-type", "alltoall"],
        moe=True),
    "gpt_oss": dict(  # gpt-oss-20b: 24 layers, hidden 2880, 64 heads / 8 KV groups, 32 experts top-4,
        # sliding window 128 on every other layer, learnable softmax sinks, biases, clamped GLU (limit 7.0)
        argv=["--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
              "--window-size", "8,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
              "--add-qkv-bias", "--normalization", "RMSNorm", "--swiglu", "--glu-linear-offset", "1.0",
              "--activation-func-clamp-value", "7.0", "--position-embedding-type", "rope", "--rotary-base", "150000",
              "--ffn-hidden-size", "128", "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
              "--moe-token-dispatcher-type", "alltoall"],
        moe=True),
    "llama3": dict(  # Llama-3-8B: 32 layers, hidden 4096, 32 heads / 8 KV groups, rope base 500000
        argv=["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "224",
              "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
              "--rotary-base", "500000"],
        moe=False),
    "llama4": dict(  # Llama-4-Scout: 48 layers, hidden 5120, 40 heads / 8 KV groups, 16 experts top-1 with
        # sigmoid scores and a shared expert, interleaved rope, no rope on every 4th layer, qk L2 norm
        argv=["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
              "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
              "--rotary-base", "500000", "--rotary-interleaved", "--no-rope-freq", "2", "--qk-l2-norm",
              "--num-experts", "8", "--moe-router-topk", "1", "--moe-router-score-function", "sigmoid",
              "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "32",
              "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
              "--moe-token-dispatcher-type", "alltoall"],
        moe=True, shared_experts=True),
    "nemotron": dict(  # Nemotron-4-15B: 32 layers, hidden 6144, 48 heads / 8 KV groups, squared ReLU,
        # zero-centred LayerNorm (--apply-layernorm-1p), rope on half the head
        argv=["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "256",
              "--normalization", "LayerNorm", "--apply-layernorm-1p", "--squared-relu", "--disable-bias-linear",
              "--position-embedding-type", "rope", "--rotary-percent", "0.5"],
        moe=False),
}


def plain_argv(name: str) -> list[str]:
    case = ZOO[name]
    return [*BASE, *case["argv"], *(MOE_PARALLEL if case["moe"] else [])]


def offload_modules(name: str) -> list[str]:
    case = ZOO[name]
    modules = list(ATTENTION_MODULES)
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
