"""LoRA's flags: what is refused, one line each, before any compute (argument parsing); the scale."""
from __future__ import annotations

import re

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
        (DENSE + ["--lora-rank", "4", "--lora-fused-adapters", "linear_qvk"],
         r"^--lora-fused-adapters=linear_qvk: not a linear LoRA adapts; did you mean linear_qkv\?$"),
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


def test_every_bad_target_at_once_each_with_the_closest_name():
    with pytest.raises(ConfigError) as info:
        arguments.parse(DENSE + ["--lora-rank", "4", "--lora-target-modules", "q_proj", "qproj", "v_proj", "gate",
                                 "mlp.experts.3.down_proj", "--dry-run"], exit_on_dry_run=False)
    assert str(info.value).splitlines() == [
        "--lora-target-modules=qproj: not a linear LoRA adapts; did you mean q_proj?",
        "--lora-target-modules=gate: this model has no such linear; did you mean gate_proj? (it has: "
        "mlp.linear_fc1, mlp.linear_fc2, self_attention.linear_proj, self_attention.linear_qkv)",
        "--lora-target-modules=mlp.experts.3.down_proj: no layer or expert index: a target names its linear in "
        "every layer (and expert); did you mean mlp.experts.down_proj?",
    ]


def test_an_unmatched_target_on_multi_latent_attention_is_one_line():
    """The closest-name hint walks peft's names, some of which this model cannot have (k_proj, v_proj
    under multi-latent attention): they are passed over, and the refusal stays one line."""
    with pytest.raises(ConfigError) as info:
        arguments.parse(MOE + ["--lora-rank", "4", "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank",
                               "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
                               "--lora-target-modules", "linear_qkv", "--dry-run"], exit_on_dry_run=False)
    assert str(info.value).startswith("--lora-target-modules=linear_qkv: this model has no such linear"), info
    assert "\n" not in str(info.value)


def test_peft_names_resolve_onto_the_linears_of_every_family_table():
    """Every linear of every family's weight table (megatron_ext/hf/weight_tables.py), by the Hugging Face
    name peft gives it, alone and with its path inside the layer, names the megatron linear of that
    row and the row's part of it (q / k / v of linear_qkv, gate / up of a gated linear_fc1)."""
    import types

    from megatron_ext.hf import weight_tables
    from megatron_ext.lora import targets

    part_of = {"qkv": ("q", "k", "v"), "glu": ("gate", "up")}
    checked = 0
    for family, table in weight_tables.TABLES.items():
        args = types.SimpleNamespace(multi_latent_attention=family.startswith("deepseek"),
                                     swiglu=family != "nemotron", quick_geglu=False)
        for megatron, hf_names, kind in table:
            module = megatron.removesuffix(".weight")
            if not megatron.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets.NAMES:
                continue
            path = targets.target_path(module.replace("{L}", "0").replace("{E}", "0"))
            for i, hf in enumerate(hf_names):
                inside = re.sub(r"^model\.layers\.\{L\}\.", "", hf).removesuffix(".weight").replace(".{E}", "")
                for name in (inside, inside.rsplit(".", 1)[-1]):
                    t = targets.resolve(name, args)
                    assert t.name is not None and targets.names(path, t.name), (family, name, path, t)
                    want = part_of[kind][i] if kind in part_of else None
                    assert t.part == want, (family, name, t)
                    assert targets.parts_adapted(path, [t]) == (None if want is None else {want})
                    checked += 1
    assert checked > 100
