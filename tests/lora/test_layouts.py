"""LoRA is exact under every parallel layout: the same losses and the same adapter gradients (every
factor, assembled from the ranks' shards by its global checkpoint key) on TP1, TP2 + sequence
parallelism (expert-TP 2 without EP with it: megatron defaults --expert-tensor-parallel-size to the TP
size), PP2, EP2, TP2 + SP with megatron's shared-expert overlap, DP2, PP2 x VPP2 (a dense model), the fused form on TP2 + SP,
multi-latent attention on TP2 + SP; and
Megatron-FSDP's losses (DP2, everything sharded) equal DDP's, with the tolerance of tests/training/test_layouts.py. The
adapters start the same everywhere: A is drawn from its global key (checked on the values), so the
comparison covers the initialisation too.

The model: a dense layer and an MoE layer with a shared expert (tiny_moe), the base drawn by
--layout-invariant-init, adapters on every attention and MLP linear (canonical q / k / v and gate / up),
on every expert and on the router. Two iterations of SGD: the first gives B its gradient (A's is 0
while B is 0), the second A's, through the updated B; SGD (not Adam, whose first step is about the
sign of the gradient) keeps rounding differences at rounding size."""
from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_distributed

# two iterations of SGD, the base drawn from its keys, rank-8 adapters; global batch 4 (micro-batch 2):
# two micro-batches a step on one data-parallel rank, whose adapter gradients accumulate, one on each of two
TRAINING = ["--train-iters", "2", "--global-batch-size", "4", "--optimizer", "sgd", "--lr", "0.5", "--min-lr", "0.5",
            "--lr-warmup-iters", "0", "--clip-grad", "0", "--layout-invariant-init", "--log-interval", "1",
            "--lora-rank", "8", "--lora-alpha", "16"]
MOE = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--moe-layer-freq", "[0,1]",
       "--moe-shared-expert-intermediate-size", "32", "--moe-router-dtype", "fp32", *TRAINING]
BASE = [*MOE, "--group-query-attention", "--num-query-groups", "2",  # 2 query heads per group in linear_qkv
        "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router"]
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "ep2": ["--expert-model-parallel-size", "2"],
    # the shared expert's linears communicate explicitly (the dispatcher gathers and reduces around them)
    "tp2-sp-shared-overlap": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1", "--moe-shared-expert-overlap"],
    "dp2": [],
}
# Megatron-FSDP takes Adam only: its run (every parameter, gradient and optimizer state sharded) is
# compared with DDP's on the same DP2 layout, losses only (its parameters are DTensor shards)
ADAM = ["--optimizer", "adam", "--lr", "1e-3", "--min-lr", "1e-3"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params", "--ckpt-format",
        "fsdp_dtensor"]
# pipeline with virtual stages needs a layer per virtual stage: tiny_dense's 4 layers
DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", *TRAINING]
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
# multi-latent attention (DeepSeek's), adapters on its five projections too
MLA = [*MOE, "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--lora-target-modules", "all-linear"]
FUSED = ["--lora-fused-adapters"]  # one pair per linear: B sharded as the base's rows (fc1's [gate; up] halves)
RTOL = 1e-5  # tests/training/test_layouts.py
GRAD_RTOL = 1e-5  # per factor, on the norm of the difference (measured: <= 4e-7)


def _tensors(result: dict) -> dict:
    return dict(result, values={k: torch.from_numpy(v) for k, v in result["values"].items()},
                grads={k: torch.from_numpy(v) for k, v in result["grads"].items()})




def _run_all():
    single = {"ref": BASE, "ref-fused": BASE + FUSED, "ref-dense": DENSE, "ref-mla": MLA}
    refs = run_distributed(1, "tests.lora.jobs:train_adapters_many",
                           argvs={name: argv + ["--world-size", "1"] for name, argv in single.items()})[0]
    ref = _tensors(refs["ref"])
    argvs = {name: BASE + extra + ["--world-size", "2"] for name, extra in LAYOUTS.items()}
    argvs["ddp-adam"] = BASE + ADAM + ["--world-size", "2"]
    argvs["fsdp-adam"] = BASE + ADAM + FSDP + ["--world-size", "2"]
    argvs["tp2-sp-fused"] = BASE + LAYOUTS["tp2-sp"] + FUSED + ["--world-size", "2"]
    argvs["pp2-vpp2"] = DENSE + VPP + ["--world-size", "2"]
    argvs["tp2-sp-mla"] = MLA + LAYOUTS["tp2-sp"] + ["--world-size", "2"]
    per_rank = run_distributed(2, "tests.lora.jobs:train_adapters_many", argvs=argvs)
    results = {name: (_tensors(per_rank[0][name]), per_rank[-1][name]) for name in argvs}
    for name in ("ref-fused", "ref-dense", "ref-mla"):
        results[name] = (_tensors(refs[name]), refs[name])
    return ref, results


@pytest.fixture(scope="module")
def runs():
    return _run_all()


def _losses(history):
    return [r["lm loss"] for r in history]


def test_the_reference_learns_and_every_factor_has_a_gradient(runs):
    ref, _ = runs
    losses = _losses(ref["history"])
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert ref["grads"].keys() == ref["values"].keys() and len(ref["grads"]) > 0
    for key, g in ref["grads"].items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, key  # A's too: B moved in the first step
    parts = {k.split(".lora.")[1].split(".")[0] for k in ref["grads"]}
    assert parts == {"q", "k", "v", "gate", "up", "all"}
    assert any(".router.lora." in k for k in ref["grads"]) and any(".experts." in k for k in ref["grads"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_and_adapter_gradients_equal_single_process(runs, layout):
    ref, results = runs
    first, last = results[layout]
    got = _losses(last["history"])  # the loss lives on the last pipeline stage
    for x, y in zip(got, _losses(ref["history"])):
        assert math.isclose(x, y, rel_tol=RTOL), (layout, got, _losses(ref["history"]))
    assert first["grads"].keys() == ref["grads"].keys(), layout
    for key, g in ref["grads"].items():
        mine = first["grads"][key]
        assert not torch.isnan(mine).any(), (layout, key)  # every shard was assembled
        assert (mine - g).norm() <= GRAD_RTOL * g.norm(), (layout, key, ((mine - g).norm() / g.norm()).item())
        assert torch.allclose(first["values"][key], ref["values"][key], rtol=1e-4, atol=1e-7), (layout, key)


def test_megatron_fsdp_losses_equal_ddp(runs):
    _, results = runs
    ddp, fsdp = _losses(results["ddp-adam"][1]["history"]), _losses(results["fsdp-adam"][1]["history"])
    assert len(ddp) == 2 and all(math.isclose(x, y, rel_tol=RTOL) for x, y in zip(fsdp, ddp)), (fsdp, ddp)


def test_fused_adapters_equal_single_process(runs):
    """--lora-fused-adapters on TP2 + SP: the same losses and adapters (a fused fc1's B, sharded as
    megatron shards [gate; up], is compared through the losses and values)."""
    ref, results = runs
    (mine, last), (single, _) = results["tp2-sp-fused"], results["ref-fused"]
    got, want = _losses(last["history"]), _losses(single["history"])
    assert all(math.isclose(x, y, rel_tol=RTOL) for x, y in zip(got, want)) and got != _losses(ref["history"])
    parts = {k.split(".lora.")[1].split(".")[0] for k in single["values"]}
    assert parts == {"all"} and mine["values"].keys() == single["values"].keys()
    for key, v in single["values"].items():
        assert torch.allclose(mine["values"][key], v, rtol=1e-4, atol=1e-7), key


@pytest.mark.parametrize("layout,ref", [("pp2-vpp2", "ref-dense"), ("tp2-sp-mla", "ref-mla")])
def test_virtual_pipeline_and_latent_attention_equal_single_process(runs, layout, ref):
    """PP2 x VPP2 (tiny_dense, a layer per virtual stage), and multi-latent attention with adapters on
    all its projections on TP2 + SP (expert-TP 2; the shared rope key's gradient summed over the
    tensor-parallel group, megatron_ext/seams/architectures.py): the same losses and adapter gradients."""
    _, results = runs
    (mine, last), (single, _) = results[layout], results[ref]
    for x, y in zip(_losses(last["history"]), _losses(single["history"])):
        assert math.isclose(x, y, rel_tol=RTOL), layout
    assert mine["grads"].keys() == single["grads"].keys() and single["grads"]
    assert layout != "tp2-sp-mla" or any("linear_kv_down_proj" in k for k in single["grads"])
    for key, g in single["grads"].items():
        assert (mine["grads"][key] - g).norm() <= GRAD_RTOL * g.norm(), key
