"""Every Hugging Face family fine-tuned on the layouts people run it with, not only TP2: on one process
(TP1), and for the MoE families also at TP1 with expert parallelism (EP2 with expert-TP 1; the published
GPT-OSS-120B layout is TP1 PP4 EP8). Each: 3 iterations of
--finetune from the import, every loss finite, and the export of each run loaded in transformers gives
the logits of our forward of that run (under its layout). gpt-oss's biased experts at one expert-TP rank
without EP (one process; TP2 with sequence parallelism and expert-TP 1) failed in megatron-core's in-place
bias add (megatron_ext/seams/moe.py), and so did the planner's trace of its published layout."""
from __future__ import annotations

import math
import os

import pytest

from tests.dist import run_distributed
from tests.hf import models, te_jobs
from tests.hf.test_hf import _tensors

# the families of docs/hf.md; Kimi-K2 is DeepSeek-V3's model (its own routing constants), DeepSeek-V2-Lite
# stands for DeepSeek-V2 here (multi-latent attention without query LoRA: its own seam)
FAMILIES = ["llama", "llama4_text", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2_lite", "gpt_oss",
            "nemotron"]
EP = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_IMPORTED: dict = {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


def imported(workdir, family: str) -> tuple[str, str]:
    """(HF directory, import) of the family, once per module."""
    if family not in _IMPORTED:
        hf_dir = models.make(workdir, family)
        ckpt = run_distributed(1, "tests.hf.te_jobs:imports", hf_dirs={family: hf_dir}, root=str(workdir))[0][family]
        _IMPORTED[family] = hf_dir, ckpt
    return _IMPORTED[family]


def _finite(losses) -> bool:
    return [i for i, _ in losses] == [1, 2, 3] and all(math.isfinite(loss) for _, loss in losses)  # --finetune: from 0


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_on_one_process_and_tp1_with_ep(workdir, family):
    import torch

    hf_dir, ckpt = imported(workdir, family)
    recipe = os.path.join(ckpt, "recipe.yaml")
    runs = {name: str(workdir / f"{family}_{name}") for name in ("one", "ep")[:2 if family in te_jobs.MOE else 1]}
    exported = {run: run + "_hf" for run in runs.values()}
    results = {}
    if "ep" in runs:
        ep = run_distributed(2, "tests.hf.te_jobs:finetune_and_forward", recipe=recipe, load=ckpt, save=runs["ep"],
                             layout=EP, world=2, ids=models.IDS)
        assert ep[1]["ours"] is None
        results["ep"] = ep[0]
    results["one"] = run_distributed(1, "tests.hf.te_jobs:one_process", recipe=recipe, load=ckpt, save=runs["one"],
                                     ids=models.IDS, exports=exported)[0]
    original = _tensors(hf_dir)
    for name, result in results.items():
        assert _finite(result["losses"]), (name, result["losses"])
        out = exported[runs[name]]
        trained = _tensors(out)
        assert trained.keys() == original.keys()
        assert any(not torch.equal(trained[k], original[k]) for k in original), name  # it trained
        models.assert_close(result["ours"], models.hf_logits(out))


def test_fine_tuned_under_context_parallelism_exports_for_transformers(workdir):
    """qwen3's import fine-tuned at CP 2 (the Ulysses all-to-all; 2 processes): the losses of the
    same fine-tune on one process within 2e-5, and its export loaded in transformers gives the logits
    of our forward of its checkpoint (on one process: our forward runs the packed row on one CP rank)."""
    hf_dir, ckpt = imported(workdir, "qwen3")
    recipe = os.path.join(ckpt, "recipe.yaml")
    save = str(workdir / "qwen3_cp2")
    cp = run_distributed(2, "tests.hf.te_jobs:finetune", recipe=recipe, load=ckpt, save=save, world=2,
                         layout=["--context-parallel-size", "2", "--cp-comm-type", "a2a"])
    one = run_distributed(1, "tests.hf.te_jobs:finetune", recipe=recipe, load=ckpt, save=str(workdir / "qwen3_cp1"),
                          layout=[], world=1)[0]
    assert _finite(cp[0]) and cp[0] == cp[1], cp
    assert all(math.isclose(a, b, rel_tol=2e-5) for (_, a), (_, b) in zip(cp[0], one)), (cp[0], one)
    ours = run_distributed(1, "tests.hf.te_jobs:forward_and_export", recipe=recipe, load=save, ids=models.IDS,
                           hf_dir=save + "_hf")[0]
    models.assert_close(ours, models.hf_logits(save + "_hf"))


def test_fine_tuned_in_fp8_exports_for_transformers(workdir):
    """qwen3's import fine-tuned with FP8 products (tensorwise e4m3, float32 weights; one process):
    its losses differ from the same fine-tune's without FP8 (FP8 is applied), and its export, which
    holds the high-precision weights, loaded in transformers gives the logits of our forward of its
    checkpoint."""
    _, ckpt = imported(workdir, "qwen3")
    recipe = os.path.join(ckpt, "recipe.yaml")
    save = str(workdir / "qwen3_fp8")
    fp8 = run_distributed(1, "tests.hf.te_jobs:finetune", recipe=recipe, load=ckpt, save=save, world=1,
                          layout=["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"])[0]
    high = run_distributed(1, "tests.hf.te_jobs:finetune", recipe=recipe, load=ckpt, save=str(workdir / "qwen3_high"),
                           layout=[], world=1)[0]
    assert _finite(fp8) and fp8 != high, (fp8, high)
    ours = run_distributed(1, "tests.hf.te_jobs:forward_and_export", recipe=recipe, load=save, ids=models.IDS,
                           hf_dir=save + "_hf")[0]
    models.assert_close(ours, models.hf_logits(save + "_hf"))


def test_gpt_oss_at_tp2_with_sequence_parallelism_and_expert_tp1(workdir):
    """Expert-TP 1 without EP under TP2+SP: an expert's fc2 reduce-scatters over one rank, the other
    case of the in-place bias add."""
    _, ckpt = imported(workdir, "gpt_oss")
    layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]
    losses = run_distributed(2, "tests.hf.te_jobs:finetune", recipe=os.path.join(ckpt, "recipe.yaml"), load=ckpt,
                             save=str(workdir / "gpt_oss_tp2"), layout=layout, world=2)
    assert _finite(losses[0]) and losses[0] == losses[1], losses


def test_planner_traces_gpt_oss_at_tp1_and_llama4_on_transformer_engine(workdir):
    """scripts/plan.py's trace (its tiny copy of the model, forward and backward at the base shape) of
    recipes/cluster/gpt_oss_120b.yaml (TP1 PP4 EP8: traced at TP1 without EP, the in-place expert bias)
    and of Llama-4's import planned for transformer-engine (megatron's fused RoPE with interleaved rope:
    its config asks transformer-engine's version), also with every layer MoE (the traced copy's
    --no-rope-freq has one entry per traced layer)."""
    _, llama4 = imported(workdir, "llama4_text")
    llama4 = [os.path.join(llama4, "recipe.yaml"), "--lr", "1e-4", "--micro-batch-size", "1", "--global-batch-size", "1",
              "--train-iters", "1"]
    runs = [[os.path.join(ROOT, "recipes", "cluster", "gpt_oss_120b.yaml")], llama4,
            [*llama4, "--moe-layer-freq", "1"]]  # every layer MoE (Llama-4-Scout): 2 traced layers, 4 in --no-rope-freq
    gpt_oss, llama4, scout = run_distributed(1, "tests.hf.te_jobs:planner_traces", runs=runs)[0]
    assert (gpt_oss["tp"], gpt_oss["ep"], gpt_oss["kinds"]) == (1, 8, ["moe", "moe"]), gpt_oss
    assert llama4["rope_fusion"] and llama4["kinds"] == ["dense", "dense", "moe", "moe"], llama4
    assert scout["kinds"] == ["moe", "moe"], scout
    for traced in (gpt_oss, llama4, scout):
        assert {"layer0", "layer1", "head"} <= set(traced["saved_by"]), traced
