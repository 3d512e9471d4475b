"""LoRA's flags: what is refused, one line each, before any compute (argument parsing); the scale."""
from __future__ import annotations

import pytest

import arguments
from megatron_ext import lora
from megatron_ext.errors import ConfigError

DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data"]
MOE = ["--recipe", "recipes/tiny_moe.yaml"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (DENSE + ["--lora-rank", "0"], r"^--lora-rank=0: must be an integer >= 1"),
        (MOE + ["--lora-rank", "16", "--lora-target-modules", "router"],
         r"^--lora-rank=16: above the width of mlp\.router \(8\)"),
        (DENSE + ["--lora-rank", "65"], r"^--lora-rank=65: above the width of self_attention\.linear_qkv \(64\)"),
        (DENSE + ["--lora-rank", "4", "--lora-dropout", "1.0"], r"^--lora-dropout=1\.0: must be a number in \[0, 1\)"),
        (DENSE + ["--lora-rank", "4", "--lora-target-modules", "router"],
         r"^--lora-target-modules=router: this model has no such linear \(it has: "),
        (DENSE + ["--lora-rank", "4", "--lora-target-modules", "linear_kv_down_proj"],
         r"^--lora-target-modules=linear_kv_down_proj: this model has no such linear"),
        (MOE + ["--lora-rank", "4", "--lora-target-modules", "shared_experts.linear_fc1"],
         r"^--lora-target-modules=shared_experts\.linear_fc1: this model has no such linear"),
        (DENSE + ["--lora-rank", "4", "--lora-target-modules", "word_embeddings"],
         r"^--lora-target-modules=word_embeddings: not a linear LoRA adapts"),
        (DENSE + ["--lora-alpha", "16"], r"^--lora-alpha=16\.0: needs --lora-rank$"),
        (DENSE + ["--lora-rank", "4", "--lora-alpha", "0"], r"^--lora-alpha=0\.0: must be a number > 0"),
        (DENSE + ["--lora-rank", "4", "--group-query-attention", "--num-query-groups", "1",
                  "--tensor-model-parallel-size", "2", "--world-size", "2"],
         r"^--tensor-model-parallel-size=2 with --lora-rank=4 on linear_qkv: .*--lora-fused-adapters$"),
        (MOE + ["--lora-rank", "8", "--lora-dropout", "0.1", "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"],
         r"^--lora-dropout=0\.1 with --moe-zero-sync-dropless on the routed experts"),
        (MOE + ["--lora-rank", "3", "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"],
         r"^--lora-rank=3 with --moe-zero-sync-dropless on the routed experts: .*multiple of 4"),
        (DENSE + ["--lora-rank", "4", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--save", "/tmp/x",
                  "--save-interval", "10", "--world-size", "2"],
         r"^--save=/tmp/x, --lora-rank=4, --use-megatron-fsdp=True: adapter-only checkpoints"),
        (DENSE + ["--lora-rank", "4", "--init-model-with-meta-device", "--use-megatron-fsdp", "--ckpt-format",
                  "fsdp_dtensor", "--world-size", "2"], r"^--lora-rank=4 with --init-model-with-meta-device"),
    ],
)
def test_refused_in_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as info:
        arguments.parse(argv + ["--dry-run"], exit_on_dry_run=False)
    assert "\n" not in str(info.value)


def test_transformer_engine_linears_are_refused_for_a_cuda_cluster():
    with pytest.raises(ConfigError, match=r"^--lora-rank=4 with --transformer-impl=transformer_engine: "):
        arguments.parse(DENSE + ["--lora-rank", "4", "--transformer-impl", "transformer_engine", "--dry-run",
                                 "--platform", "cuda", "--assume-te"], exit_on_dry_run=False)


def test_scale_and_default_targets():
    args = arguments.parse(MOE + ["--lora-rank", "16", "--lora-alpha", "32", "--moe-shared-expert-intermediate-size",
                                  "32", "--dry-run"], exit_on_dry_run=False)
    assert lora.scale(args) == 2.0
    assert lora.target_list(args) == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    args.lora_rslora = True
    assert lora.scale(args) == 32 / 4
    args.lora_target_modules = ["all-linear"]
    assert lora.target_list(args)[-1] == "router"
    mla = arguments.parse(MOE + ["--lora-rank", "4", "--multi-latent-attention", "--q-lora-rank", "32",
                                 "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
                                 "--v-head-dim", "16", "--dry-run"], exit_on_dry_run=False)
    assert lora.target_list(mla) == ["linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                     "linear_kv_up_proj", "linear_fc1", "linear_fc2"]
