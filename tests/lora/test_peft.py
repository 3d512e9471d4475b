"""One LoRA step equals peft's: a tiny random Qwen3 (GQA, query/key norms, SwiGLU) made offline with
transformers, imported (megatron_ext.hf, what scripts/convert.py import runs), one step of ours with
adapters on every attention and MLP linear (canonical q / k / v and gate / up); peft's LoRA on
transformers' model, given the same factors, on the same batch: the same loss and, for every factor,
the same gradient (cosine >= 0.9999, norms within 1e-4). B starts random here so that A has a
gradient too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.dist import run_distributed
from tests.hf import models

ARGV = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0", "--clip-grad", "0",
        "--log-interval", "1", "--num-workers", "0", "--lora-rank", "4", "--lora-alpha", "8", "--world-size", "1"]

# megatron's linear and adapter part -> the module peft adapts (Llama / Qwen3 names): the naming a peft
# import / export maps (docs/finetune.md)
PEFT_NAMES = {("self_attention.linear_qkv", "q"): "self_attn.q_proj",
              ("self_attention.linear_qkv", "k"): "self_attn.k_proj",
              ("self_attention.linear_qkv", "v"): "self_attn.v_proj",
              ("self_attention.linear_proj", "all"): "self_attn.o_proj",
              ("mlp.linear_fc1", "gate"): "mlp.gate_proj", ("mlp.linear_fc1", "up"): "mlp.up_proj",
              ("mlp.linear_fc2", "all"): "mlp.down_proj"}


def peft_name(ours: str) -> str:
    """``decoder.layers.1.self_attention.linear_qkv.lora.k.lora_A.weight`` ->
    ``base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight`` (peft's saved key)."""
    linear, rest = ours.split(".lora.")
    part, factor = rest.split(".", 1)
    layer, module = linear.removeprefix("decoder.layers.").split(".", 1)
    return f"base_model.model.model.layers.{layer}.{PEFT_NAMES[(module, part)]}.{factor}"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_peft")
    return root, models.make(root, "qwen3")


@pytest.fixture(scope="module")
def compared(qwen3):
    return _compare(*qwen3, "ckpt", [], sorted({v.rsplit(".", 1)[-1] for v in PEFT_NAMES.values()}))


def _compare(root, hf_dir: str, ckpt: str, extra: list, peft_targets: list) -> dict:
    """One step of ours (ARGV + extra) and peft's LoRA on ``peft_targets``, with our factors."""
    from peft import LoraConfig, get_peft_model

    ours = run_distributed(1, "tests.lora.jobs:one_lora_step", hf_dir=hf_dir, ckpt=str(root / ckpt),
                           argv=ARGV + extra)[0]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=peft_targets)
    model = get_peft_model(models.load_hf(hf_dir, dtype=torch.float32), config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in ours["values"].items():  # (ours may hold more: the parts peft does not adapt)
            name = peft_name(key).replace(".weight", ".default.weight")
            if name in params:
                params[name].copy_(torch.from_numpy(value))
    batch = {k: torch.from_numpy(v) for k, v in ours["batch"].items()}
    logits = model(input_ids=batch["tokens"]).logits.float()
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().float()
    loss = (losses * mask).sum() / mask.sum()
    loss.backward()
    theirs = {name.replace(".default.weight", ".weight"): p.grad.numpy()
              for name, p in params.items() if "lora_" in name}
    return dict(ours={peft_name(k): v for k, v in ours["grads"].items()}, theirs=theirs, our_loss=ours["loss"],
                their_loss=float(loss), values={peft_name(k): v for k, v in ours["values"].items()})


def test_one_step_gradients_equal_peft(compared):
    ours, theirs = compared["ours"], compared["theirs"]
    assert ours.keys() == theirs.keys() and len(ours) == 2 * 7 * 2  # 2 layers x 7 linears x (A, B)
    _same_step(compared)


def test_peft_module_names_as_targets_adapt_what_peft_adapts(qwen3):
    """--lora-target-modules by peft's names (q_proj v_proj gate_proj down_proj: parts of the fused
    linear_qkv and linear_fc1, and a whole linear): the same loss and gradients as peft's LoRA on
    those modules; the parts they leave out of linear_qkv and linear_fc1 (k, up) hold A = B = 0 and get
    zero gradients (so they stay zero); o_proj, which no name covers, has no adapter."""
    names = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    compared = _compare(*qwen3, "ckpt_names", ["--lora-target-modules", *names], names)
    ours, theirs = compared["ours"], compared["theirs"]
    assert len(theirs) == 2 * 4 * 2
    inert = {k for k in ours if k not in theirs}
    assert {k.split(".")[-3] for k in inert} == {"k_proj", "up_proj"} and len(inert) == 2 * 2 * 2
    assert not any("o_proj" in k for k in ours)
    for k in inert:
        assert not compared["values"][k].any() and not ours[k].any(), k
    _same_step(compared)


def _same_step(compared):
    ours, theirs = compared["ours"], compared["theirs"]
    assert abs(compared["our_loss"] - compared["their_loss"]) <= 1e-5 * abs(compared["their_loss"])
    for name, g in theirs.items():
        mine, ref = ours[name].astype(np.float64).ravel(), g.astype(np.float64).ravel()
        cos = mine @ ref / (np.linalg.norm(mine) * np.linalg.norm(ref))
        assert np.linalg.norm(ref) > 0 and cos >= 0.9999, (name, cos)
        assert abs(np.linalg.norm(mine) / np.linalg.norm(ref) - 1) <= 1e-4, name
