"""FP8 composes: activation offload changes nothing (bitwise losses and gradient norms), a resumed run
logs the uninterrupted run's losses bitwise, an FP8-trained checkpoint loads and trains in high
precision, LoRA trains its adapters on an FP8 base."""
from __future__ import annotations

from tests.dist import run_distributed

ARGV = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--num-layers", "2", "--global-batch-size", "2",
        "--seq-length", "32", "--log-interval", "1", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
        "--hidden-dropout", "0.1"]


def _losses(history):
    return [(h["iteration"], repr(h["lm loss"]), h["grad norm"]) for h in history]


def test_fp8_composes(tmp_path):
    r = run_distributed(1, "tests.fp8.jobs:compose", argv=ARGV, save=str(tmp_path / "ckpt"))[0]
    straight = _losses(r["straight"])
    assert len(straight) == 3
    assert r["offloaded_bytes"] > 0 and _losses(r["offloaded"]) == straight
    assert _losses(r["first"]) + _losses(r["resumed"]) == straight
    loaded = r["high_precision_from_fp8"]
    assert [h["iteration"] for h in loaded] == [3] and loaded[0]["lm loss"] == loaded[0]["lm loss"]
    assert repr(loaded[0]["lm loss"]) != straight[2][1]  # it ran in high precision
    lora = r["lora"]
    assert lora["fp8_linears"] == 8 and len(lora["losses"]) == 3


# float32 weights with FP8 products: a layout's rounding stays far below what FP8 itself changes
_COMMON = ["--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1", "--train-iters", "2",
           "--lr-warmup-iters", "0", "--layout-invariant-init", "--hidden-dropout", "0", "--attention-dropout", "0",
           "--world-size", "2"]
_DENSE = ["--recipe", "recipes/tiny_dense.yaml", "--mock-data", "--num-layers", "4", "--seq-length", "32", *_COMMON]
_MOE = ["--recipe", "recipes/tiny_moe.yaml", "--num-layers", "2", "--seq-length", "32", "--moe-router-dtype", "fp32",
        *_COMMON]
_MOE_ZERO_SYNC = [*_MOE, "--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]  # the grouped FP8 experts
_SFT = ["--recipe", "recipes/tiny_sft.yaml", "--eval-iters", "0", *_COMMON]
_FP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"]
_OVERLAP = ["--overlap-tp-comm-1f1b"]
LAYOUTS = {  # name: (model, the layout's flags); each against its model's FP8 run at DP2
    "tp2-sp-overlap": (_DENSE, ["--tensor-model-parallel-size", "2", "--sequence-parallel", *_OVERLAP]),
    "pp2": (_DENSE, ["--pipeline-model-parallel-size", "2"]),
    "pp2-vpp2": (_DENSE, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "megatron-fsdp": (_DENSE, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                               "--ckpt-format", "fsdp_dtensor"]),
    "fsdp2": (_DENSE, ["--use-torch-fsdp2"]),
    "moe-ep2-overlap": (_MOE, ["--expert-model-parallel-size", "2", *_OVERLAP]),
    "moe-zero-sync-ep2-overlap": (_MOE_ZERO_SYNC, ["--expert-model-parallel-size", "2", *_OVERLAP]),
    "sft-tp2-sp": (_SFT, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}
LAYOUT_RTOL = 5e-6  # measured: at most 1.5e-6 (EP2's expert rows in another order)
FP8_MOVES = 1e-5  # FP8 against float32 products on the same run, dense and SFT: 4e-5 measured


def _worst(a: dict, b: dict) -> float:
    pairs = list(zip(a["losses"] + a["grad_norms"], b["losses"] + b["grad_norms"]))
    assert len(pairs) == 4, (a, b)
    return max(abs(x - y) / abs(y) for x, y in pairs)


def test_fp8_on_every_layout_and_wrapper():
    """FP8 under the 1F1B overlap (TP2 + SP; EP2 with MoE, megatron's experts and the zero-sync layer's), PP2, PP2 x VPP2, Megatron-FSDP, FSDP2, and
    SFT on packed conversations at TP2 + SP: losses and grad norms of 2 iterations within 5e-6 of the same
    model's FP8 run at DP2, while FP8 itself moves them by more than 1e-5 (against float32 products)."""
    models = {"dense": _DENSE, "moe": _MOE, "moe-zero-sync": _MOE_ZERO_SYNC, "sft": _SFT}
    argvs = {f"{name} fp8": [*model, *_FP8] for name, model in models.items()}
    argvs.update({f"{name} high": list(model) for name, model in models.items() if not name.startswith("moe")})
    argvs.update({layout: [*model, *_FP8, *flags] for layout, (model, flags) in LAYOUTS.items()})
    last = run_distributed(2, "tests.training.jobs_cp:train_grads_many", argvs=argvs, grads=False)[-1]
    for name in ("dense", "sft"):
        assert _worst(last[f"{name} fp8"], last[f"{name} high"]) > FP8_MOVES, name  # FP8 is applied
    for layout, (model, _) in LAYOUTS.items():
        name = next(n for n, m in models.items() if m is model)
        assert _worst(last[layout], last[f"{name} fp8"]) <= LAYOUT_RTOL, (layout, last[layout], last[f"{name} fp8"])
