"""Adapters in and out of peft (megatron_ext/hf/peft/, packed.py; scripts/convert.py import --peft,
export --peft / --hf, logits of packed sequences), on tiny random models made offline (tests/hf/models.py)
and random adapters made by peft itself:

- a dense Qwen3 adapter on every attention and MLP linear (rslora), and a DeepSeek-V3 adapter on
  multi-latent attention's projections, the stacked routed experts (peft's target_parameters: one A over
  gate and up per expert) and a shared expert's gate alone;
- its logits with the adapter, ours running three sequences packed into one forward, transformers +
  peft running each alone: cosine >= 0.9999, max |diff| <= 1e-3 of the largest logit, the same top-1, on
  one process and on two (TP2 + sequence parallelism, EP2 for the experts; PP2 for the dense model);
- import -> export of the untouched adapter: every tensor bit-identical, the config equivalent;
- three LoRA iterations (the dense one continuing the imported adapter; the DeepSeek one with fresh
  canonical adapters on every linear and the router of its base): peft loads our export and gives our
  logits; the merged export equals peft's merge_and_unload(), tensor by tensor and in logits;
- refusals, one line naming what: a field peft has that we cannot represent, ranks or scales that
  differ, an adapter of another model (a shape), of a module we do not adapt, a --peft export of a run
  without adapters."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed
from tests.hf import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQUENCES = [[3, 17, 100, 5, 599], [42, 7, 300, 1], [2, 250, 60, 9]]  # 13 tokens: TP2 pads one

ADAPTERS = {
    "qwen3": dict(r=4, lora_alpha=8, use_rslora=True,
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "deepseek_v3": dict(r=4, lora_alpha=8, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                           "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                                           "mlp.shared_experts.gate_proj.weight"]),
}
TRAIN = {  # (where the LoRA run starts, its flags)
    "qwen3": ("ckpt", []),
    "deepseek_v3": ("ckpt/base", ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "all-linear",
                                  "--moe-router-bias-update-rate", "0"]),
}
SHARDED = {
    "qwen3": {"tp2sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
              "pp2": ["--pipeline-model-parallel-size", "2"]},
    "deepseek_v3": {"tp2sp_ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]},
}
_DONE: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("peft_io")


def make_adapter(hf_dir: str, out: str, seed: int = 3, **config) -> str:
    """peft's LoRA on the transformers model, every factor random (B too: the adapter changes the
    logits), saved by peft."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(models.load_hf(hf_dir, dtype=torch.float32), LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(out)
    return out


def story(workdir, family: str) -> dict:
    """The family's model and adapter, made; imported, run, exported, trained (once per module)."""
    if family not in _DONE:
        root = workdir / family
        hf_dir = models.make(root, family)
        peft_dir = make_adapter(hf_dir, str(root / "adapter"), **ADAPTERS[family])
        start, flags = TRAIN[family]
        result = run_distributed(1, "tests.hf.jobs_peft:adapter_story", hf_dir=hf_dir, peft_dir=peft_dir,
                                 root=str(root), sequences=SEQUENCES, train=[str(root / start), flags])[0]
        result["sharded"] = run_distributed(2, "tests.hf.jobs_peft:logits_under", load=str(root / "ckpt"),
                                            sequences=SEQUENCES, layouts=SHARDED[family])
        _DONE[family] = dict(result, hf=hf_dir, peft=peft_dir, root=root)
    return _DONE[family]


def peft_logits(hf_dir: str, adapter: str, merged: bool = False):
    """transformers + peft on each sequence alone, concatenated: [tokens, vocab]; with ``merged``,
    also the model merge_and_unload() gives."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(models.load_hf(hf_dir, dtype=torch.float32), adapter).eval()
    if merged:
        model = model.merge_and_unload().eval()
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([s])).logits[0].float() for s in SEQUENCES])
    return (logits, model) if merged else logits


def _tensors(directory: str, pattern: str = "*.safetensors") -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(directory, pattern))):
        out.update(load_file(path))
    return out


FAMILIES = list(ADAPTERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_adapter_logits_equal_peft_packed_on_each_layout(workdir, family):
    s = story(workdir, family)
    ref = peft_logits(s["hf"], s["peft"])
    assert not torch.allclose(ref, torch.cat([models.hf_logits(s["hf"], q) for q in SEQUENCES]), atol=1e-2)
    models.assert_close(s["imported"], ref)
    for name in SHARDED[family]:
        assert s["sharded"][1][name] is None, name
        models.assert_close(s["sharded"][0][name], ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_of_an_untouched_adapter_is_bitwise(workdir, family):
    s = story(workdir, family)
    theirs, ours = _tensors(s["peft"]), _tensors(str(s["root"] / "roundtrip"))
    assert theirs.keys() == ours.keys() and len(ours) == len(s["roundtrip"])
    for key, t in theirs.items():
        assert t.dtype == ours[key].dtype and torch.equal(t.view(-1).view(torch.uint8), ours[key].view(-1).view(torch.uint8)), key
    with open(os.path.join(s["peft"], "adapter_config.json")) as f:
        a = json.load(f)
    with open(s["root"] / "roundtrip" / "adapter_config.json") as f:
        b = json.load(f)
    for key in ("peft_type", "r", "lora_alpha", "use_rslora", "lora_dropout", "bias", "use_dora", "rank_pattern",
                "alpha_pattern"):
        assert a.get(key) == b.get(key), (key, a.get(key), b.get(key))
    for key in ("target_modules", "target_parameters"):
        assert set(a.get(key) or []) == set(b.get(key) or []), (key, a.get(key), b.get(key))


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_adapter_loads_in_peft_with_our_logits(workdir, family):
    s = story(workdir, family)
    assert len(s["losses"]) == 3 and s["losses"][-1] < s["losses"][0], s["losses"]
    ours = torch.as_tensor(s["trained"])
    assert not torch.allclose(ours, torch.as_tensor(s["imported"]), atol=1e-3)  # it trained
    trained = str(s["root"] / "trained")
    models.assert_close(ours, peft_logits(s["hf"], trained))
    with open(os.path.join(trained, "adapter_config.json")) as f:
        config = json.load(f)
    # the base the run was trained from: the model its base checkpoint was imported from, which peft's
    # AutoPeftModelForCausalLM then loads by itself (the adapter's logits without naming the base)
    assert config["base_model_name_or_path"] == os.path.abspath(s["hf"]), config
    if family == "qwen3":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
        with torch.no_grad():
            models.assert_close(ours, torch.cat([model(torch.tensor([q])).logits[0].float() for q in SEQUENCES]))
    if family == "deepseek_v3":  # canonical gate / up per expert: peft's block-diagonal rank-2r form
        assert config["rank_pattern"] == {r"mlp\.experts\.gate_up_proj": 8}, config
        assert config["alpha_pattern"] == {r"mlp\.experts\.gate_up_proj": 16.0}, config
        # the dense layer's and the shared expert's MLP, and the router: target_parameters, which peft's
        # MoE conversion of target_modules leaves alone
        assert {"mlp.gate_proj.weight", "mlp.shared_experts.up_proj.weight", "mlp.gate.weight",
                "mlp.experts.gate_up_proj"} <= set(config["target_parameters"]), config


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_export_equals_merge_and_unload(workdir, family):
    s = story(workdir, family)
    logits, model = peft_logits(s["hf"], str(s["root"] / "trained"), merged=True)
    merged_dir = str(s["root"] / "merged")
    models.assert_close(torch.cat([models.hf_logits(merged_dir, q) for q in SEQUENCES]), logits)
    theirs, ours = model.state_dict(), _tensors(merged_dir)
    stacked = {}  # transformers (v5) stacks the routed experts: gate_up_proj [E, 2f, h], down_proj [E, h, f]
    for key in [k for k in ours if ".mlp.experts." in k]:
        layer, expert, name = key.split(".mlp.experts.")[0], int(key.split(".mlp.experts.")[1].split(".")[0]), key.rsplit(".", 2)[-2]
        stacked.setdefault((layer, "down_proj" if name == "down_proj" else "gate_up_proj"), {}).setdefault(expert, {})[name] = ours.pop(key)
    for (layer, name), experts in stacked.items():
        parts = ("down_proj",) if name == "down_proj" else ("gate_proj", "up_proj")
        ours[f"{layer}.mlp.experts.{name}"] = torch.stack([torch.cat([experts[e][p] for p in parts]) for e in sorted(experts)])
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    for key, t in theirs.items():
        assert torch.allclose(ours[key], t, rtol=0, atol=1e-6), (key, (ours[key] - t).abs().max())


# ---------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------
def _variant(src: str, dst: str, config=None, tensors=None) -> str:
    """A copy of the adapter directory with its config edited and tensors replaced or added."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            raw = json.load(f)
        config(raw)
        with open(path, "w") as f:
            json.dump(raw, f)
    if tensors:
        path = os.path.join(dst, "adapter_model.safetensors")
        raw = load_file(path)
        tensors(raw)
        save_file(raw, path)
    return dst


def test_refusals_name_what_is_not_representable(workdir):
    from megatron_ext import hf

    s = story(workdir, "qwen3")
    bad = str(workdir / "refused")
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    cases = {
        "use_dora": (dict(config=lambda c: c.update(use_dora=True)), r"use_dora=True: DoRA's magnitude vectors"),
        "bias": (dict(config=lambda c: c.update(bias="lora_only")), r"bias='lora_only': the adapter trains the base's"),
        "modules_to_save": (dict(config=lambda c: c.update(modules_to_save=["lm_head"])),
                            r"modules_to_save=\['lm_head'\]: whole trained copies"),
        "pissa": (dict(config=lambda c: c.update(init_lora_weights="pissa")),
                  r"init_lora_weights='pissa': peft rewrites the base weights"),
        "replication": (dict(config=lambda c: c.update(layer_replication=[[0, 2]])),
                        r"layer_replication=\[\[0, 2\]\]: not representable"),
        "rank": (dict(config=lambda c: c.update(rank_pattern={"q_proj": 8}),
                      tensors=lambda t: [t.update({k: torch.zeros(8, 64) if "lora_A" in k else torch.zeros(128, 8)})
                                         for k in list(t) if ".q_proj." in k]),
                 r"rank_pattern: model.layers.0.self_attn.q_proj has rank 8, the others 4: a LoRA run here has one rank"),
        "alpha": (dict(config=lambda c: c.update(alpha_pattern={"o_proj": 16})),
                  r"alpha_pattern: model.layers.0.self_attn.o_proj is scaled 8, the others 4"),
        "shape": (dict(tensors=lambda t: t.update({f"{q}.lora_B.weight": torch.zeros(96, 4)})),
                  rf"{q}.lora_B.weight: shape \(96, 4\) does not match the base \(128, 4\) .*another model"),
        "lm_head": (dict(tensors=lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
                                                      "base_model.model.lm_head.lora_B.weight": torch.zeros(640, 4)})),
                    r"lm_head.lora_A.weight: adapts lm_head, which megatron_ext's LoRA does not adapt"),
        "other_model": (dict(tensors=lambda t: t.update(
            {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
             "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(128, 4)})),
            r"adapts model.layers.7.self_attn.q_proj, which the base model does not have"),
    }
    for name, (edit, expected) in cases.items():
        with pytest.raises(ConfigError, match=expected) as caught:
            hf.import_peft(s["hf"], _variant(s["peft"], str(workdir / f"peft_{name}"), **edit), bad,
                           parse=arguments.parse)
        assert "\n" not in str(caught.value) and str(caught.value).startswith("--peft="), (name, caught.value)
    assert not os.path.exists(bad)  # refused before anything is written
    with pytest.raises(ConfigError, match=r"no adapter_config.json \(not a peft adapter directory\)"):
        hf.import_peft(s["hf"], s["hf"], bad, parse=arguments.parse)
    from megatron_ext.hf import packed

    assert packed.parse_ids("3,17; 42,7,1;") == [[3, 17], [42, 7, 1]]
    with pytest.raises(ConfigError, match=r"--input-ids=3,x: comma-separated token ids, sequences separated by ';'"):
        packed.parse_ids("3,x")
    assert s["no_adapters"] == (f"--load={s['root'] / 'ckpt' / 'base'}: its newest checkpoint holds no LoRA adapters (a "
                                "full or imported model): export it with --hf"), s["no_adapters"]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "convert.py"), "import", "--hf", s["hf"],
                        "--peft", str(workdir / "peft_use_dora"), "--save", bad], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith(
        f"error: --peft={workdir / 'peft_use_dora'}: adapter_config.json: use_dora=True: "), p.stderr
