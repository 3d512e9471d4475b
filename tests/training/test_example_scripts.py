"""Megatron-LM's example launch scripts, through train.py.

The flag arrays below are those of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh and examples/mixtral/train_mixtral_8x7b_distributed.sh
(identical at the core_v0.19.0 tag and on the main branch), word for word as bash expands them.
The scripts' own arguments (data prefix, tokenizer files, checkpoint and TensorBoard folders) are
substituted with tokenizers and data made here (tests/training/local_tokenizers.py).

1. `--dry-run --world-size W` at each script's own world size (the GPUs its parallel layout needs):
   GPT-3 175B TP8 x PP16 = 128 (16 nodes of 8), Llama-3 8B DP8 = 8, Mixtral 8x7B PP4 x EP8 = 32
   (4 nodes). What had to change, and why, is in CHANGES.
2. Scaled down (sizes, batch, lengths, parallel degrees) but with every other flag as written,
   a few iterations train on CPU with finite losses.
"""
from __future__ import annotations

import contextlib
import io
import math

import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed
from tests.training import local_tokenizers

GPT3 = {
    "world": 128,
    "argv": [
        # GPT_MODEL_ARGS
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "1536",
        "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
        "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine",
        "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        # DATA_ARGS
        "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE", "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", "$CHECKPOINT_PATH",
        "--load", "$CHECKPOINT_PATH", "--eval-iters", "10", "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
    ],
}

LLAMA3 = {  # DTYPE=fp8 in the script adds DTYPE_ARGS; see CHANGES
    "world": 8,
    "argv": [
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",  # DDP_ARGS
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
        # DATA_ARGS_LIST (real data); "--split '99,1,0'" is one array element, so bash passes the quotes
        "--data-path", "$DATA_ARG", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "$TOKENIZER_ARG",
        "--data-cache-path", "$DATA_CACHE_PATH", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
        "--no-mmap-bin-files", "--num-workers", "1", "--vocab-size", "128256",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
        "torch_dist", "--distributed-timeout-minutes", "60", "--save", "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH",
        "--tensorboard-dir", "$TENSORBOARD_LOGS_PATH",
    ],
}

MIXTRAL = {
    "world": 32,
    "argv": [
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096", "--max-position-embeddings", "32768",
        "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
        "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization",
        "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion", "--no-position-embedding",
        "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
        "--overlap-param-gather", "--overlap-grad-reduce",
        # DATA_ARGS
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "$TOKENIZER_MODEL", "--data-path", "$DATA_PATH",
        "--split", "99990,8,2",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4", "--train-iters", "500000",
        "--lr-decay-iters", "320000", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
        "--lr-warmup-iters", "500", "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
        "--use-distributed-optimizer", "--sequence-parallel",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--save",
        "$CHECKPOINT_PATH", "--load", "$CHECKPOINT_PATH", "--tensorboard-dir", "$CHECKPOINT_PATH/tensorboard",
        "--no-load-optim", "--no-load-rng",
    ],
}

# What had to change, on this machine (no GPU, no transformer-engine), and why.
CHANGES = {
    "gpt3": {
        "drop": {"--step-batch-size-schedule": "megatron itself refuses it next to --global-batch-size "
                 "('Cannot specify both'), and this loop keeps the global batch constant"},
        "add": {"--tokenizer-type": ("GPT2BPETokenizer", "the script names none; megatron's default is none, "
                                     "and its --vocab-file/--merge-file are GPT-2's")},
    },
    "llama3": {
        "drop": {"--profile": "without --use-pytorch-profiler it is an nsys capture range, CUDA only",
                 "--profile-step-start": "goes with --profile", "--profile-step-end": "goes with --profile",
                 "--cross-entropy-loss-fusion": "a fused kernel: transformer-engine/CUDA",
                 "--attention-backend": "'fused' is transformer-engine's attention, refused on the local spec "
                                        "(its auto / flash run torch's attention)"},
        "script_variables": {"DTYPE": ("bf16", "the default fp8 adds --fp8-* flags, which need transformer-engine")},
    },
    "mixtral": {
        "drop": {"--moe-grouped-gemm": "grouped GEMM kernels need CUDA"},
    },
}

TAKES_VALUE = {"--profile-step-start", "--profile-step-end", "--attention-backend", "--step-batch-size-schedule"}


def apply_changes(name: str, argv: list[str]) -> list[str]:
    change = CHANGES[name]
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in change.get("drop", {}):
            skip = a in TAKES_VALUE
            continue
        out.append(a)
    for flag, (value, _why) in change.get("add", {}).items():
        out += [flag, value]
    return out


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    made = local_tokenizers.make(root)
    # enough documents that every split of the scripts' --split holds some (99990,8,2 needs > 25,000)
    made["gpt2_data"] = local_tokenizers.prepare(root, "gpt2", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                                                made["vocab"], "--merge-file", made["merges"]], 2000)
    made["hf_data"] = local_tokenizers.prepare(root, "hf", ["--tokenizer-type", "HuggingFaceTokenizer",
                                                            "--tokenizer-model", made["hf"]], 2000)
    made["sp_data"] = local_tokenizers.prepare(root, "sp", ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                                            made["sp"]], 30000)
    return made


def substitute(argv: list[str], assets, tmp_path) -> list[str]:
    paths = {
        "$DATA_PATH": None, "$VOCAB_FILE": assets["vocab"], "$MERGE_FILE": assets["merges"],
        "$TOKENIZER_ARG": assets["hf"], "$TOKENIZER_MODEL": assets["sp"], "$DATA_ARG": assets["hf_data"],
        "$DATA_CACHE_PATH": str(tmp_path / "cache"), "$CHECKPOINT_PATH": str(tmp_path / "ckpt"),
        "$TENSORBOARD_LOGS_PATH": str(tmp_path / "tb"), "$CHECKPOINT_PATH/tensorboard": str(tmp_path / "ckpt" / "tb"),
    }
    out = [paths.get(a) or a for a in argv]
    if "$TOKENIZER_ARG" in argv and "--vocab-size" in out:  # the script's size is its tokenizer's: so is ours
        from transformers import AutoTokenizer

        out[out.index("--vocab-size") + 1] = str(len(AutoTokenizer.from_pretrained(assets["hf"])))
    return out


def _data(name, assets):
    return {"gpt3": assets["gpt2_data"], "llama3": assets["hf_data"], "mixtral": assets["sp_data"]}[name]


SCRIPTS = {"gpt3": GPT3, "llama3": LLAMA3, "mixtral": MIXTRAL}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_example_script_dry_run_at_its_world_size(name, assets, tmp_path):
    script = SCRIPTS[name]
    argv = [_data(name, assets) if a == "$DATA_PATH" else a for a in substitute(script["argv"], assets, tmp_path)]
    argv = apply_changes(name, argv)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        args = arguments.parse(argv + ["--dry-run", "--world-size", str(script["world"])], exit_on_dry_run=False)
    assert "resolved configuration" in out.getvalue()
    sizes = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.data_parallel_size
    assert sizes * args.context_parallel_size == script["world"]
    assert args.padded_vocab_size % (args.make_vocab_size_divisible_by * args.tensor_model_parallel_size) == 0
    if name == "llama3":  # sample-based, as written
        assert args.train_iters == 1953125000 // 128 and args.data_parallel_size == 8
    if name == "mixtral":
        assert args.expert_model_parallel_size == 8 and args.pipeline_model_parallel_size == 4


# The scripts' DTYPE=fp8 (the default) adds these, word-split as bash does.
LLAMA3_FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
              "--fp8-param-gather"]


@pytest.mark.parametrize("name", ["llama3", "mixtral"])
def test_example_script_as_written_passes_a_cuda_dry_run(name, assets, tmp_path):
    """Nothing dropped (fp8, --profile's nsys range, --moe-grouped-gemm, fused kernels): validated as
    the cluster would, at the script's world size, megatron's device queries answered for its GPU."""
    script = SCRIPTS[name]
    argv = [_data(name, assets) if a == "$DATA_PATH" else a for a in substitute(script["argv"], assets, tmp_path)]
    argv += LLAMA3_FP8 if name == "llama3" else []
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(argv + ["--dry-run", "--platform", "cuda", "--assume-te", "--world-size",
                                       str(script["world"])], exit_on_dry_run=False)
    assert args.transformer_impl == "transformer_engine" and "h100" in args.target_platform
    assert (args.fp8 == "hybrid") if name == "llama3" else args.moe_grouped_gemm
    assert args.profile == (name == "llama3")
    # the same script on this machine is refused, and the line says where it validates
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(ConfigError) as refused:
        arguments.parse(argv + ["--dry-run", "--world-size", str(script["world"])], exit_on_dry_run=False)
    assert "--platform cuda --assume-te" in str(refused.value) or "CUDA GPU" in str(refused.value)


# examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh with its defaults (USE_MEGATRON_FSDP=1,
# SHARDING_STRATEGY=optim_grads_params, TP=1, EP=8, MBS=4, GBS=2048, PROFILE=0): PRETRAIN_ARGS, then
# the Megatron-FSDP additions, word for word as bash expands them. WANDB=1 (its default) adds
# DEEPSEEK_V3_WANDB, validated where the wandb package is installed (as megatron's writer needs it).
DEEPSEEK_V3_FSDP = [
    "--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "8",
    "--expert-tensor-parallel-size", "1", "--context-parallel-size", "1", "--use-distributed-optimizer",
    "--overlap-grad-reduce", "--overlap-param-gather", "--use-mcore-models", "--sequence-parallel", "--use-flash-attn",
    "--disable-bias-linear", "--micro-batch-size", "4", "--global-batch-size", "2048", "--train-samples", "585937500",
    "--exit-duration-in-mins", "220", "--no-check-for-nan-in-loss-and-grad", "--manual-gc", "--manual-gc-interval",
    "10", "--recompute-granularity", "selective", "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm",
    "--transformer-impl", "transformer_engine", "--seq-length", "4096", "--data-cache-path", "$OUTPUT_PATH/cache",
    "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "deepseek-ai/DeepSeek-V3", "--data-path",
    "$DATA_PATH", "--split", "99,1,0", "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader",
    "--num-workers", "6", "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
    "--num-attention-heads", "128", "--kv-channels", "128", "--max-position-embeddings", "4096",
    "--position-embedding-type", "rope", "--rotary-base", "10000", "--make-vocab-size-divisible-by", "3232",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0",
    "--weight-decay", "0.1", "--qk-layernorm", "--lr-decay-samples", "584765624", "--lr-warmup-samples", "1536000",
    "--lr-warmup-init", "3.9e-7", "--lr", "3.9e-6", "--min-lr", "3.9e-7", "--lr-decay-style", "cosine",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--num-experts", "256", "--moe-layer-freq", "[0]*3+[1]*58",
    "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk", "8", "--moe-token-dispatcher-type",
    "flex", "--moe-flex-dispatcher-backend", "hybridep", "--moe-router-pre-softmax", "--moe-grouped-gemm",
    "--moe-aux-loss-coeff", "1e-4", "--moe-router-group-topk", "4", "--moe-router-num-groups", "8",
    "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3", "--moe-router-dtype", "fp32",
    "--moe-permute-fusion", "--moe-router-force-load-balancing", "--q-lora-rank", "1536", "--kv-lora-rank", "512",
    "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--rotary-scaling-factor", "40",
    "--mscale", "1.0", "--mscale-all-dim", "1.0", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
    "--eval-iters", "32", "--eval-interval", "100", "--auto-detect-ckpt-format", "--load", "$OUTPUT_PATH/checkpoints",
    "--save", "$OUTPUT_PATH/checkpoints", "--save-interval", "100", "--dist-ckpt-strictness", "log_all",
    "--init-method-std", "0.02", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
    "--log-num-zeros-in-grad", "--log-params-norm", "--log-validation-ppl-to-tensorboard", "--log-throughput",
    "--log-interval", "1", "--logging-level", "40", "--tensorboard-dir", "$OUTPUT_PATH/tensorboard", "--bf16",
    "--enable-experimental",
    # USE_MEGATRON_FSDP=1
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--no-gradient-accumulation-fusion",
    "--use-distributed-optimizer", "--calculate-per-token-loss", "--init-model-with-meta-device", "--ckpt-format",
    "fsdp_dtensor", "--fsdp-double-buffer", "--use-nccl-ub", "--megatron-fsdp-grad-comm-dtype", "bf16",
    "--megatron-fsdp-main-grads-dtype", "bf16",
]
DEEPSEEK_V3_WANDB = ["--wandb-project", "your_own_wandb_project", "--wandb-exp-name", "DeepSeek-V3-TP1EP8-MBS4GBS2048-"]


@pytest.mark.parametrize("world", [8, 256])
def test_deepseek_v3_fsdp_script_as_written_passes_a_cuda_dry_run(world, assets, tmp_path):
    """The script leaves its node count to the cluster (#SBATCH --nodes); its layout (TP1, EP8, its
    batch of 512 micro-batches of 4) runs on any multiple of 8 GPUs dividing 512 x 8: one node and 32
    nodes. Data aside (the data prefix, the Hugging Face tokenizer read from the hub: local ones here),
    as written, on the cluster it targets (CUDA, transformer-engine)."""
    import importlib.util

    paths = {"$DATA_PATH": assets["hf_data"], "deepseek-ai/DeepSeek-V3": assets["hf"]}
    argv = [paths.get(a, a).replace("$OUTPUT_PATH", str(tmp_path)) for a in DEEPSEEK_V3_FSDP]
    argv += DEEPSEEK_V3_WANDB if importlib.util.find_spec("wandb") else []
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(argv + ["--dry-run", "--platform", "cuda", "--assume-te", "--world-size", str(world)],
                               exit_on_dry_run=False)
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    assert args.data_parallel_size == world and args.expert_model_parallel_size == 8
    assert args.nccl_ub and args.fsdp_double_buffer and args.fsdp_manual_registration  # megatron's: --use-nccl-ub
    assert args.init_model_with_meta_device and args.moe_token_dispatcher_type == "flex"
    assert args.train_iters == 585937500 // 2048 and args.multi_latent_attention and args.mtp_num_layers == 1


# Scaled down: the sizes, batch, lengths and parallel degrees; every other flag as written.
SCALE = {
    "gpt3": (4, {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
                 "--max-position-embeddings": "64", "--global-batch-size": "4", "--train-iters": "3",
                 "--lr-decay-iters": "3", "--lr-warmup-fraction": "0.2", "--tensor-model-parallel-size": "2",
                 "--pipeline-model-parallel-size": "2", "--eval-interval": "2", "--eval-iters": "1",
                 "--log-interval": "1", "--split": "60,20,20"}),
    "llama3": (2, {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
                   "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "64",
                   "--max-position-embeddings": "64", "--global-batch-size": "4", "--train-samples": "12",
                   "--lr-decay-samples": "12", "--lr-warmup-samples": "4", "--eval-interval": "2", "--eval-iters": "1",
                   "--num-workers": "0", "--split": "80,20,0"}),
    "mixtral": (4, {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
                    "--num-attention-heads": "4", "--num-query-groups": "2", "--seq-length": "64",
                    "--max-position-embeddings": "128", "--global-batch-size": "4", "--train-iters": "3",
                    "--lr-decay-iters": "3", "--lr-warmup-iters": "1", "--pipeline-model-parallel-size": "2",
                    "--expert-model-parallel-size": "2", "--eval-interval": "2", "--eval-iters": "1",
                    "--split": "60,20,20"}),
}


def scale(argv: list[str], values: dict) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in values:
            out[i + 1] = values[a]
    return out


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_example_script_scaled_down_trains_on_cpu(name, assets, tmp_path):
    world, values = SCALE[name]
    argv = [_data(name, assets) if a == "$DATA_PATH" else a for a in substitute(SCRIPTS[name]["argv"], assets, tmp_path)]
    # --num-workers 0: the test pool's processes are daemonic and cannot start data-loader workers
    argv = scale(apply_changes(name, argv), values) + ["--num-workers", "0", "--world-size", str(world)]
    out = run_distributed(world, "tests.training.jobs_flags:train_capture", argv=argv)
    history, stdout = out[-1]["history"], out[-1]["stdout"]
    assert len(history) == 3 and all(math.isfinite(r["lm loss"]) for r in history)
    assert " validation loss at iteration 2 (at --eval-interval " in stdout
