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
              "aux_loss", "--moe-aux-loss-coeff", "1e-3"]
_LLAMA3_70B = ["--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64",
               "--group-query-attention", "--num-query-groups", "8", "--vocab-size", "128256", "--rotary-base", "500000",
               "--seq-length", "8192", "--max-position-embeddings", "8192"]
_FP8_CS = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]

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
    # performance-summary 25.11, DGX-H100: Qwen3_30B_a3B 16 GPUs FP8-CS TP1 PP2 VP24 EP8 MBS2 GBS512
    "qwen3-30b-a3b 16xH100 PP2 VP24 EP8 fp8": dict(
        gpu="h100", argv=[*_QWEN3_30B, *_COMMON, *_FP8_CS, "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1", "--expert-model-parallel-size", "8",
                          "--micro-batch-size", "2", "--global-batch-size", "512", "--world-size", "16"],
        source="Megatron-Bridge performance summary 25.11, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=5275.0),
    # performance-summary 25.09, DGX-H100: DeepSeekV3 (dropless) 1024 GPUs TP2 PP8 VP4 EP64 MBS1 GBS8192,
    # FP8 (blockwise; 338 model TFLOP/s/GPU). The recipe's model (MLA, 256 experts, MTP), its layer split
    # over 8 x 4 chunks: the first chunk 3 dense layers... as megatron's pipeline layout
    "deepseek-v3 1024xH100 TP2 PP8 VP4 EP64 fp8": dict(
        gpu="h100", argv=["--recipe", "recipes/cluster/deepseek_v3.yaml", *_FP8_CS, "--pipeline-model-parallel-size", "8",
                          "--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "0",
                          "--pipeline-model-parallel-layout", "Et|(tt|)*30mL", "--activation-offload-modules",
                          "--global-batch-size", "8192", "--num-workers", "0"],
        source="Megatron-Bridge performance summary 25.09, DGX-H100", peak_gib=None, tokens_per_s_per_gpu=1297.0),
}
