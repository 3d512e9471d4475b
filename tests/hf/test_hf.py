"""Hugging Face in and out (megatron_ext/hf, scripts/convert.py), on tiny random models of every
supported family made offline with transformers' config classes (tests/hf/models.py):
import -> export is bit-identical and loads cleanly in transformers; our forward equals
transformers' on one process and under TP2 (+SP; EP2 for MoE); an import fine-tunes 3 iterations on
a sharded layout with offload and the TP-overlapped schedule, and its export equals our forward of
the trained checkpoint; every refusal is one line naming what is refused."""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed
from tests.hf import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DONE: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def imported(workdir, family: str) -> dict:
    """The family's HF directory, imported and exported once per module."""
    if family not in _DONE:
        hf_dir = models.make(workdir, family)
        ckpt, out = str(workdir / f"{family}_ckpt"), str(workdir / f"{family}_out")
        result = run_distributed(1, "tests.hf.jobs:import_export", hf_dir=hf_dir, ckpt=ckpt, out=out)[0]
        _DONE[family] = dict(result, hf=hf_dir, ckpt=ckpt, out=out)
    return _DONE[family]


def _tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _bitwise_equal(a, b) -> list:
    import torch

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))]


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_import_export_bitwise_and_loads_in_transformers(workdir, family):
    from transformers import AutoTokenizer

    r = imported(workdir, family)
    assert len(r["shards"]) > 1 and os.path.isfile(os.path.join(r["out"], "model.safetensors.index.json"))
    with open(os.path.join(r["out"], "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"].values()) == set(r["shards"])
    assert not _bitwise_equal(_tensors(r["hf"]), _tensors(r["out"]))
    _, info = models.load_hf(r["out"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert AutoTokenizer.from_pretrained(r["out"])("def f(x): return x")["input_ids"] == \
        AutoTokenizer.from_pretrained(r["hf"])("def f(x): return x")["input_ids"]


LAYOUTS = {  # world 2: TP2 with sequence parallelism; MoE models also EP2
    "dense": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "moe": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
            "--expert-tensor-parallel-size", "1"],
}


def _layout(family):
    return LAYOUTS["moe" if family in ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "deepseek_v2_lite", "kimi_k2",
                                "gpt_oss", "llama4_text") else "dense"]


@pytest.mark.parametrize("family", list(models.FAMILIES))
def test_forward_equals_transformers_single_and_tp2(workdir, family):
    r = imported(workdir, family)
    if family == "llama":  # too few positions for the forward to tell the llama3 factor: the recipe carries it
        import yaml

        with open(os.path.join(r["ckpt"], "recipe.yaml")) as f:
            recipe = yaml.safe_load(f)
        assert recipe["use_rope_scaling"] and recipe["rope_scaling_factor"] == 32.0, recipe
        assert recipe["untie_embeddings_and_output_weights"] is False
    if family == "llama4_text":  # exact up to its temperature tuning's floor_scale - 1 (NoPE layers), refused after
        import yaml

        with open(os.path.join(r["ckpt"], "recipe.yaml")) as f:
            recipe = yaml.safe_load(f)
        assert recipe["max_position_embeddings"] == 8191 and recipe["no_rope_freq"] == "[1,0,0,1]", recipe
        # Scout's llama-3 scaling (too few positions for the forward to tell it either)
        assert recipe["rope_scaling_factor"] == 16.0 and recipe["rope_scaling_high_freq_factor"] == 1.0, recipe
        assert "rope_scaling_low_freq_factor" not in recipe, recipe
    ref = models.hf_logits(r["hf"])
    single = run_distributed(1, "tests.hf.jobs:logits", load=r["ckpt"], ids=models.IDS, flags=[])[0]
    models.assert_close(single, ref)
    sharded = run_distributed(2, "tests.hf.jobs:logits", load=r["ckpt"], ids=models.IDS, flags=_layout(family))
    assert sharded[1] is None
    models.assert_close(sharded[0], ref)


@pytest.mark.parametrize("pipeline", [["--num-layers-per-virtual-pipeline-stage", "1"],
                                      ["--decoder-first-pipeline-num-layers", "1"]], ids=["vpp2", "uneven"])
def test_llama4_forward_under_pipeline_layouts(workdir, pipeline):
    """Llama-4's NoPE layers (no query/key norm) found by their global layer number on each pipeline
    stage and virtual stage: an uneven split (1 + 3 layers) and PP2 x VPP2 give transformers' logits."""
    r = imported(workdir, "llama4_text")
    out = run_distributed(2, "tests.hf.jobs:logits", load=r["ckpt"], ids=models.IDS,
                          flags=["--pipeline-model-parallel-size", "2", *pipeline])
    assert out[1] is None
    models.assert_close(out[0], models.hf_logits(r["hf"]))


def test_llama4_layer_lists_default_as_transformers_derives_them(workdir):
    """A Llama-4 config.json without its layer lists (no_rope_layers empty, no moe_layers, no
    layer_types: what Meta's published text configs hold) gives the recipe the lists transformers
    derives from no_rope_layer_interval and interleave_moe_layer_step."""
    from transformers import AutoConfig

    from megatron_ext.hf import families

    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=640, num_hidden_layers=8,
                  intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                  head_dim=16, interleave_moe_layer_step=2, no_rope_layer_interval=4, tie_word_embeddings=False)
    full = AutoConfig.for_model("llama4_text", **fields).to_dict()
    bare = dict(full, no_rope_layers=[])
    for key in ("moe_layers", "layer_types"):
        bare.pop(key)
    derived = families.flags("llama4_text", families.Config(bare))
    assert derived == families.flags("llama4_text", families.Config(full))
    assert derived["no_rope_freq"] == "[0,0,0,1,0,0,0,1]" and derived["moe_layer_freq"] == "[0,1,0,1,0,1,0,1]"


def test_finetune_three_iterations_then_export_equals_ours(workdir):
    """Qwen3-MoE from its import: --finetune on TP2+SP, EP2, the distributed optimizer, activation
    offload and the TP-overlapped 1F1B schedule, 3 iterations, saved; the export of that checkpoint
    in transformers gives our forward's logits (under the training layout) on the trained weights."""
    import torch

    r = imported(workdir, "qwen3_moe")
    run = str(workdir / "qwen3_moe_run")
    recipe = os.path.join(r["ckpt"], "recipe.yaml")
    argv = ["--recipe", recipe, "--load", r["ckpt"], "--finetune", "--save", run, "--save-interval", "3", "--mock-data", "--num-workers", "0",
            "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3",
            "--lr", "1e-2", "--world-size", "2", "--use-distributed-optimizer", "--log-interval", "1",
            "--activation-offload-modules", "core_attention", "qkv_linear", "attn_proj",
            "--activation-offload-min-tensor-kb", "0", "--overlap-tp-comm-1f1b", *_layout("qwen3_moe")]
    history = run_distributed(2, "tests.hf.jobs:train", argv=argv)[0]
    assert [h["iteration"] for h in history] == [1, 2, 3], history  # --finetune: from iteration 0
    out = str(workdir / "qwen3_moe_trained")
    run_distributed(1, "tests.hf.jobs:export", load=run, out=out, recipe=recipe)
    trained, original = _tensors(out), _tensors(r["hf"])
    assert len(_bitwise_equal(trained, original)) > len(original) // 2  # it trained
    ours = run_distributed(2, "tests.hf.jobs:logits", load=run, ids=models.IDS, flags=_layout("qwen3_moe"),
                           recipe=recipe)[0]
    models.assert_close(ours, models.hf_logits(out))
    assert not torch.allclose(torch.as_tensor(ours), models.hf_logits(r["hf"]), atol=1e-3)


def test_finetune_from_an_import_under_megatron_fsdp(workdir):
    """An import (torch_dist, weights only) fine-tuned under Megatron-FSDP (ZeRO-3, EP2): the weights
    load into the model before Megatron-FSDP shards it, and the losses and grad norms are those of
    the same fine-tune under DDP + the distributed optimizer."""
    import math

    r = imported(workdir, "qwen3_moe")
    argv = ["--recipe", os.path.join(r["ckpt"], "recipe.yaml"), "--load", r["ckpt"], "--finetune", "--mock-data",
            "--num-workers", "0", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "2", "--lr", "1e-2", "--world-size", "2", "--log-interval", "1",
            "--expert-model-parallel-size", "2"]
    fsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy",
            "optim_grads_params"]
    out = run_distributed(2, "tests.hf.jobs:finetune_under_ddp_and_fsdp", argv=argv, fsdp=fsdp)[0]
    assert len(out["fsdp"]) == 2 and out["fsdp"][0][0] == out["ddp"][0][0], out  # the same weights, bit for bit
    assert all(math.isclose(a, b, rel_tol=1e-6) for x, y in zip(out["ddp"], out["fsdp"]) for a, b in zip(x, y)), out
    assert any("resuming from checkpoint" in line and "iter_0000000" in line for line in out["fsdp printed"]), out
    assert out["fsdp printed"][-1] == "[checkpoint] the torch_dist weights were loaded before Megatron-FSDP sharded the model"


def test_grouped_gemm_loads_an_import_unchanged(workdir):
    """--moe-grouped-gemm (a CUDA flag) with an import: the recipe builds the local spec, where
    megatron-core's LocalSpecProvider gives SequentialMLP with the flag as without it, so the
    per-expert names the import wrote are the ones the model loads; the flag passes validation for
    a CUDA target."""
    import contextlib
    import io

    import arguments
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    for grouped in (False, True):
        experts = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=grouped).submodules.mlp.keywords[
            "submodules"].experts
        assert experts.func is SequentialMLP
    r = imported(workdir, "qwen3_moe")
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(["--recipe", os.path.join(r["ckpt"], "recipe.yaml"), "--mock-data", "--world-size", "2",
                                "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--load", r["ckpt"],
                                "--finetune", "--lr", "1e-5", "--micro-batch-size", "1", "--global-batch-size", "2",
                                "--train-iters", "1", "--dry-run", "--platform", "cuda", "--assume-no-te"],
                               exit_on_dry_run=False)
    assert args.moe_grouped_gemm and args.transformer_impl == "local"


def test_refusals_are_one_line_naming_what(workdir):
    from megatron_ext import hf

    import_hf = functools.partial(hf.import_hf, parse=arguments.parse)
    r = imported(workdir, "llama")
    bad = workdir / "bad"
    with pytest.raises(ConfigError, match=r"no such directory"):
        import_hf(str(workdir / "nowhere"), str(bad))
    with pytest.raises(ConfigError, match=r"no config.json"):
        import_hf(str(workdir), str(bad))

    def variant(name, edit=None, drop=None, src=r["hf"]):
        d = str(workdir / name)
        shutil.copytree(src, d)
        if edit:
            with open(os.path.join(d, "config.json")) as f:
                config = json.load(f)
            edit(config)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(config, f)
        if drop:
            os.remove(os.path.join(d, drop))
        return d

    with pytest.raises(ConfigError, match=r"architecture JambaForCausalLM \(model_type jamba\) is not supported"):
        import_hf(variant("jamba", lambda c: c.update(model_type="jamba", architectures=["JambaForCausalLM"])), str(bad))
    with pytest.raises(ConfigError, match=r"Llama4ForConditionalGeneration \(model_type llama4\) is not supported "
                       r"\(a text-and-vision Llama-4: import its text model alone, a Llama4ForCausalLM"):
        import_hf(variant("l4", lambda c: c.update(model_type="llama4",
                                                      architectures=["Llama4ForConditionalGeneration"])), str(bad))
    with pytest.raises(ConfigError, match=r"missing shard model-00002-of-"):
        import_hf(variant("noshard", drop=_hf_shards(r["hf"])[1]), str(bad))
    with pytest.raises(ConfigError, match=r"attention_bias=True: attention biases are not mapped"):
        import_hf(variant("bias", lambda c: c.update(attention_bias=True)), str(bad))
    with pytest.raises(ConfigError, match=r"rope_parameters.rope_type='dynamic': supported: default, llama3"):
        import_hf(variant("rope", lambda c: c["rope_parameters"].update(rope_type="dynamic")), str(bad))
    oss = imported(workdir, "gpt_oss")["hf"]
    with pytest.raises(ConfigError, match=r"swiglu_alpha=1.5: megatron's --quick-geglu fixes alpha at 1.702"):
        import_hf(variant("alpha", lambda c: c.update(swiglu_alpha=1.5), src=oss), str(bad))
    with pytest.raises(ConfigError, match=r"quantization_config=.*this field is not representable"):  # MXFP4
        import_hf(variant("mxfp4", lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), src=oss), str(bad))
    l4 = imported(workdir, "llama4_text")["hf"]
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=2: megatron scales the expert input by the router "
                       r"score \(--moe-apply-probs-on-input\) for top-1 routing only"):
        import_hf(variant("l4top2", lambda c: c.update(num_experts_per_tok=2), src=l4), str(bad))
    with pytest.raises(ConfigError, match=r"config.json: some_new_field=3: this field is not representable"):
        import_hf(variant("field", lambda c: c.update(some_new_field=3)), str(bad))
    jobs = run_distributed(1, "tests.hf.test_hf:_refused_in_build",
                           shape=variant("shape", lambda c: c.update(intermediate_size=80)),
                           dtype=variant("dtype", lambda c: c.update(dtype="bfloat16")), bad=str(bad),
                           ckpt=r["ckpt"])[0]
    assert "shape (192, 64) does not match the config's (160, 64)" in jobs["shape"], jobs
    assert "dtype float32 does not match the config's bfloat16" in jobs["dtype"], jobs
    assert "holds model weights only (an imported model): load it with --finetune" in jobs["no_finetune"], jobs


def _hf_shards(d):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "model-*.safetensors")))


def _refused_in_build(shape, dtype, bad, ckpt):
    """Refusals found once the model is built (one rank)."""
    import train

    from megatron_ext import hf

    out = {}
    for name, d in (("shape", shape), ("dtype", dtype)):
        try:
            hf.import_hf(d, bad, parse=arguments.parse)
        except ConfigError as e:
            out[name] = str(e)
    try:
        train.main(["--recipe", os.path.join(ckpt, "recipe.yaml"), "--load", ckpt, "--mock-data", "--lr", "1e-3",
                    "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1", "--world-size", "1",
                    "--num-workers", "0"])
    except ConfigError as e:
        out["no_finetune"] = str(e)
    return out


def test_a_conversion_reads_the_checkpoint_once_and_the_import_records_no_training_flags(workdir, tmp_path):
    """export --hf, export --peft and logits each read their --load once (hf/checkpoint.py find): one
    listing, one recipe, one common state, one checksum manifest and each file's checksum once, then
    the weights; their run (its parser, checks and load, megatron-core's load included) is handed what
    find read and reads none of it again. The adapter checkpoint's export and logits load its base too
    (another directory, not counted). The import is a model-only run: what its checkpoint records of how
    it was launched holds the flags the import gave (--save ...), none of the values megatron's parser
    asks every run for."""
    from tests.hf.test_peft_io import make_adapter

    r = imported(workdir, "llama")
    adapter = make_adapter(r["hf"], str(tmp_path / "peft"), r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    lora = str(tmp_path / "lora")
    out = run_distributed(1, "tests.hf.jobs_convert:conversions_counting_reads", peft=(r["hf"], adapter, lora),
                          conversions=[("export --hf", "hf", r["ckpt"], str(tmp_path / "hf")),
                                       ("export --peft", "peft", lora, str(tmp_path / "peft_out")),
                                       ("logits", "logits", lora, None)])[0]
    for name, reads in out.items():
        assert reads["read"] == {"listing": 1, "recipe": 1, "common state": 1, "manifest": 1}, (name, reads)
        assert reads["by the run"] == {} and reads["summed"] == {".metadata": 1, "__0_0.distcp": 1}, (name, reads)
    assert out["export --hf"]["iteration"] == 0
    with open(os.path.join(r["ckpt"], "iter_0000000", "recipe.yaml")) as f:
        launched = f.read().split("# the run's own flags")[1]
    assert "# save_interval: 1" in launched and "# no_save_optim: true" in launched, launched
    for stand_in in ("lr", "min_lr", "mock_data", "train_iters", "micro_batch_size", "global_batch_size",
                     "lr_warmup_iters", "num_workers"):
        assert f"# {stand_in}:" not in launched, launched


def _dry_run(argv: list) -> str:
    """Job: train.py's bring-up of a --dry-run (without exiting): what it printed."""
    import contextlib
    import io

    from megatron_ext.training.run import Run

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        Run.from_argv(argv, exit_on_dry_run=False, parse=arguments.parse)
    return printed.getvalue()


def test_dry_run_places_the_keys_in_the_whole_model(workdir):
    """train.py --dry-run --load: the run's whole model on the meta device, then the configuration and the
    key check's line last. Without a launcher (a process of its own) the whole model is built in a world
    of this process held in memory; a key it cannot place is then the one line printed."""
    r = imported(workdir, "llama")
    argv = ["--load", r["ckpt"], "--finetune", "--mock-data", "--lr", "1e-5", "--micro-batch-size", "1",
            "--train-iters", "1", "--num-workers", "0", "--dry-run"]
    printed = run_distributed(1, "tests.hf.test_hf:_dry_run", argv=argv)[0]
    assert printed.startswith("resolved configuration"), printed
    assert printed.splitlines()[-1].startswith(
        "  checkpoint_keys 'iter_0000000: every weight placed in the local spec: 8'"), printed
    refused = subprocess.run([sys.executable, "train.py", *argv, "--qk-layernorm"], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.strip().splitlines()[-1].startswith(
        f"error: --load={r['ckpt']}: the checkpoint has no decoder.layers.self_attention.k_layernorm.weight"), \
        refused.stderr


def test_cli_refuses_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "jamba", "architectures": ["JambaForCausalLM"]}))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"), "import", "--hf", str(tmp_path),
                        "--save", str(tmp_path / "ckpt")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 1, p
    assert p.stderr.strip().splitlines()[-1:] == [
        f"error: --hf={tmp_path}: architecture JambaForCausalLM (model_type jamba) is not supported "
        "(supported: deepseek_v2, deepseek_v3, gpt_oss, kimi_k2, llama, llama4_text, mixtral, nemotron, qwen3, "
        "qwen3_moe)"], p.stderr
