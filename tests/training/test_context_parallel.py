"""Context parallelism on the local spec with torch's attention, trained: losses and gradients at CP 2
and 4 against CP 1 on the same global batch (fp32, 4 gloo ranks: DP4, DP2 x CP2, CP4), every comm type
in one model through a per-layer --cp-comm-type list, on the model zoo's attention kinds (GQA with
qk-layernorm; multi-latent attention with MoE, experts over data x context ranks; gpt-oss's sliding
windows and sinks, with all_gather and a2a, the comm types that express them); packed SFT (documents
masked, the loss token-weighted across CP ranks) against its data-parallel run."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tests.dist import run_distributed
from tests.training import zoo

TOL = 2e-5
_RUNS: dict = {}

BASE = [
    "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
    "--train-iters", "1", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234", "--init-method-std", "0.02",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--transformer-impl", "local",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "257", "--make-vocab-size-divisible-by", "80",
    "--num-workers", "0", "--log-interval", "1", "--untie-embeddings-and-output-weights", "--world-size", "4",
]
ALL_TYPES = ["p2p", "all_gather", "a2a"]
MASKED_TYPES = ["all_gather", "a2a", "all_gather"]  # windows and sinks: the comm types that express them


def _arch(name: str) -> list[str]:
    argv = list(zoo.ZOO[name]["argv"])
    for flag in ("--moe-layer-freq", "--mtp-num-layers"):  # 3 layers here; MTP stays off
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    return argv


CASES = {  # name: (model flags, per-layer comm types)
    "qwen3": (_arch("qwen3"), ALL_TYPES),  # GQA, qk-layernorm
    # MLA + MoE; documents of at most 8 tokens with their ends out of the loss: the CP ranks' loss tokens
    # differ (the loss stays token-weighted across them)
    "deepseek_v2_lite": (_arch("deepseek_v2_lite") + ["--moe-layer-freq", "[0,1,1]", "--eod-mask-loss"], ALL_TYPES),
    # sliding windows on every other layer, learnable softmax sinks, MoE: all_gather and a2a only
    "gpt_oss": (_arch("gpt_oss"), MASKED_TYPES),
}


def _layouts(name: str) -> dict:
    model, types = CASES[name]
    moe = ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-router-dtype", "fp32"] \
        if "--num-experts" in model else []
    argv = [*BASE, *model, *moe]
    return {"cp1": argv,
            "cp2": [*argv, "--context-parallel-size", "2", "--cp-comm-type", *types],
            "cp4": [*argv, "--context-parallel-size", "4", "--cp-comm-type", *types[::-1]]}


def _run(name: str) -> dict:
    if name not in _RUNS:
        start = time.perf_counter()
        _RUNS[name] = run_distributed(4, "tests.training.jobs_cp:train_grads_many", argvs=_layouts(name),
                                      document_tokens=8 if "--eod-mask-loss" in CASES[name][0] else None)[0]
        _RUNS[name]["seconds"] = time.perf_counter() - start
    return _RUNS[name]


def _within_tol(got: list, ref: list, where) -> None:
    """Each logged value (losses, then grad norms) within TOL relative of the reference's."""
    for a, b in zip(got, ref):
        assert abs(a - b) <= TOL * abs(b), where


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", list(CASES))
def test_losses_and_gradients_equal_cp1(name):
    """Losses, grad norms and every parameter's gradient (rank 0's: the dense ones and its experts)
    at CP 2 and CP 4 within 2e-5 relative of CP 1's, with p2p, all_gather and a2a layers."""
    result = _run(name)
    ref = result["cp1"]
    assert len(ref["losses"]) == 1 and ref["grads"]
    for layout in ("cp2", "cp4"):
        got = result[layout]
        _within_tol(got["losses"] + got["grad_norms"], ref["losses"] + ref["grad_norms"],
                    (layout, got["losses"], ref["losses"]))
        assert got["grads"].keys() == ref["grads"].keys()
        worst = max((_rel(got["grads"][k], ref["grads"][k]), k) for k in ref["grads"])
        assert worst[0] <= TOL, (layout, worst)


SFT = ["--recipe", "recipes/tiny_sft.yaml", "--train-iters", "2", "--lr-warmup-iters", "0", "--log-interval", "1",
       "--eval-iters", "0", "--layout-invariant-init", "--world-size", "4"]


def test_packed_sft_equals_data_parallel():
    """Packed conversations (a document mask per row, the loss on assistant tokens): DP4 against CP4
    (all_gather and a2a layers; each conversation's rows split over 4 ranks, their assistant tokens
    unevenly): the same losses, grad norms and gradients within 2e-5."""
    start = time.perf_counter()
    result = run_distributed(4, "tests.training.jobs_cp:train_grads_many", argvs={
        "dp4": SFT, "cp4": [*SFT, "--context-parallel-size", "4", "--cp-comm-type", "all_gather", "a2a"]})[0]
    _RUNS["sft_seconds"] = time.perf_counter() - start
    ref, got = result["dp4"], result["cp4"]
    assert len(ref["losses"]) == 2 and ref["losses"][1] < ref["losses"][0]
    _within_tol(got["losses"] + got["grad_norms"], ref["losses"] + ref["grad_norms"], (got, ref))
    worst = max((_rel(got["grads"][k], ref["grads"][k]), k) for k in ref["grads"])
    assert worst[0] <= TOL, worst


def test_pipeline_virtual_stages_and_offload_compose():
    """PP2 with 2 virtual stages x CP2 (per-layer p2p / all_gather / a2a / p2p) with core attention's
    saved tensors offloaded, against PP2 x DP2 on the same global batch: the same losses, grad norms and
    first-stage gradients within 2e-5."""
    model, _ = CASES["qwen3"]
    argv = [*BASE, *model, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
            "--num-virtual-stages-per-pipeline-rank", "2"]
    ranks = run_distributed(4, "tests.training.jobs_cp:train_grads_many", argvs={
        "dp2": argv,
        "cp2": [*argv, "--context-parallel-size", "2", "--cp-comm-type", "p2p", "all_gather", "a2a", "p2p",
                "--activation-offload-modules", "core_attention", "--activation-offload-min-tensor-kb", "0"]})
    ref, got = ranks[0]["dp2"], ranks[0]["cp2"]  # rank 0: the first stage's gradients
    last_ref, last_got = ranks[-1]["dp2"], ranks[-1]["cp2"]  # the last stage's losses
    assert len(last_ref["losses"]) == 1
    _within_tol(last_got["losses"] + got["grad_norms"], last_ref["losses"] + ref["grad_norms"],
                (got["losses"], ref["losses"]))
    assert got["grads"].keys() == ref["grads"].keys() and ref["grads"]
    worst = max((_rel(got["grads"][k], ref["grads"][k]), k) for k in ref["grads"])
    assert worst[0] <= TOL, worst


# each feature composed with CP: (its flags, the comm types of the 3 layers); dense qwen3 unless MoE
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-router-dtype", "fp32",
             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
COMPOSED = {
    "lora": ["--lora-rank", "8", "--lora-alpha", "16"],
    "megatron_fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                      "--ckpt-format", "fsdp_dtensor"],
    "fsdp2": ["--use-torch-fsdp2"],
    "sync_free": [*MOE_FLAGS, "--moe-sync-free-dispatcher"],
    "zero_sync": [*MOE_FLAGS, "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"],
}


def test_features_compose_with_context_parallelism():
    """LoRA, Megatron-FSDP (everything sharded), FSDP2, the sync-free dispatcher and the zero-sync
    dropless layer (experts over DP x CP), each at DP2 x CP2 (all_gather, a2a, p2p layers) against the
    same at DP4: losses and grad norms over 2 iterations within 2e-5."""
    model, _ = CASES["qwen3"]
    argv = [*BASE, *model, "--train-iters", "2"]
    argvs = {}
    for name, flags in COMPOSED.items():
        argvs[f"{name} dp4"] = [*argv, *flags]
        argvs[f"{name} cp2"] = [*argv, *flags, "--context-parallel-size", "2", "--cp-comm-type", *ALL_TYPES]
    result = run_distributed(4, "tests.training.jobs_cp:train_grads_many", argvs=argvs, grads=False)[0]
    for name in COMPOSED:
        ref, got = result[f"{name} dp4"], result[f"{name} cp2"]
        assert len(ref["losses"]) == 2 and all(np.isfinite(ref["losses"])), (name, ref["losses"])
        _within_tol(got["losses"] + got["grad_norms"], ref["losses"] + ref["grad_norms"], (name, got, ref))


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4(tmp_path):
    """Saved at iteration 2 of a DP2 x CP2 run, resumed at DP4 (CP 1) and at CP 4: iterations 3 and 4
    carry the losses and grad norms of the uninterrupted CP 2 run within 2e-5."""
    model, _ = CASES["qwen3"]
    argv = [*BASE, *model, "--train-iters", "4", "--lr-decay-iters", "4"]
    cp2 = ["--context-parallel-size", "2", "--cp-comm-type", *ALL_TYPES]
    save = str(tmp_path / "cp2")
    result = run_distributed(4, "tests.training.jobs_cp:train_grads_many", argvs={
        "straight": [*argv, *cp2],
        "saved": [*argv, *cp2, "--save", save, "--save-interval", "2", "--exit-interval", "2"],
        "cp1": [*argv, "--load", save],
        "cp4": [*argv, "--load", save, "--context-parallel-size", "4", "--cp-comm-type", *ALL_TYPES[::-1]],
    })[0]
    straight = result["straight"]
    assert len(straight["losses"]) == 4 and result["saved"]["losses"] == straight["losses"][:2]
    for layout in ("cp1", "cp4"):
        got = result[layout]
        assert len(got["losses"]) == 2, (layout, got["losses"])
        _within_tol(got["losses"] + got["grad_norms"], straight["losses"][2:] + straight["grad_norms"][2:],
                    (layout, got, straight))
