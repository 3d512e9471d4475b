"""Published H100 runs the planner is checked (and its efficiency constants calibrated once) against:
Megatron-Bridge's performance summary (docs/performance-summary.md, 25.09 / 25.11 NeMo containers)
and its expert-parallel overlap notes. Each case: the run's flags for scripts/plan.py (no recipe),
the GPU, the source, and the published figures (None where none is published)."""
from __future__ import annotations

GIB = 2**30
_COMMON = ["--tokenizer-type", "NullTokenizer", "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0",
           "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--position-embedding-type", "rope", "--use-distributed-optimizer", "--overlap-grad-reduce",
           "--overlap-param-gather", "--bf16", "--lr", "1e-4", "--train-iters", "10", "--num-workers", "0"]
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

CASES = {
    # examples/post_training/modelopt/conf/Qwen/Qwen3-30B-A3B.sh model flags; skills/
    # nemo-mbridge-perf-expert-parallel-overlap: 62.17 GiB peak allocated (rank 0), 41.25 s per step
    # with the plain alltoall dispatcher and no CUDA graphs
    "qwen3-30b-a3b 16xH100 EP16": dict(
        gpu="h100", argv=[*_QWEN3_30B, *_COMMON, "--expert-model-parallel-size", "16", "--micro-batch-size", "1",
                          "--global-batch-size", "1024", "--world-size", "16"],
        source="Megatron-Bridge EP-overlap notes: BF16, alltoall, no graphs",
        peak_gib=62.17, tokens_per_s_per_gpu=1024 * 4096 / 41.25 / 16),
    # performance-summary 25.09, DGX-H100: LLAMA3_70B 64 GPUs FP8-CS TP4 PP8 VP5 MBS1 GBS128 seq 8192
    "llama3-70b 64xH100 TP4 PP8 VP5 fp8": dict(
        gpu="h100", argv=[*_LLAMA3_70B, *_COMMON, *_FP8_CS, "--tensor-model-parallel-size", "4", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                          "--micro-batch-size", "1", "--global-batch-size", "128", "--world-size", "64"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1619.0),
    # performance-summary 25.09, DGX-H100: Qwen3_235B_a22B (tokendrop) 256 GPUs TP2 PP8 VP4 EP32 MBS1
    # GBS2048 (FP8-CS per the 25.11 table's H100 row); 94 layers + embedding + loss in 32 chunks of 3
    "qwen3-235b-a22b 256xH100 TP2 PP8 VP4 EP32 fp8": dict(
        gpu="h100", argv=[*_QWEN3_235B, *_COMMON, *_FP8_CS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "3",
                          "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                          "--expert-model-parallel-size", "32", "--expert-tensor-parallel-size", "1",
                          "--micro-batch-size", "1", "--global-batch-size", "2048", "--world-size", "256"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1204.0),
    # performance-summary 25.09, DGX-H100: DeepSeekV3 (dropless) 1024 GPUs TP2 PP8 VP4 EP64 MBS1 GBS8192,
    # FP8 (blockwise; 338 model TFLOP/s/GPU); 61 layers (3 dense) + one MTP layer in 32 model chunks
    "deepseek-v3 1024xH100 TP2 PP8 VP4 EP64 fp8": dict(
        gpu="h100", argv=[*_DEEPSEEK_V3, *_COMMON, *_FP8_CS, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et|(tt|)*30mL",
                          "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
                          "--micro-batch-size", "1", "--global-batch-size", "8192", "--world-size", "1024"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1297.0),
}
