"""train: train.py end to end, a few iterations (dense with offload, MoE with the sync-free dispatcher)."""
from __future__ import annotations

import math
import os

from gpu_check_sections.common import ROOT, claim


def run_train(argv) -> dict:
    from train import main as train_main

    from megatron_ext import moe, offload

    before = moe.installed
    try:
        history = train_main(list(argv))
        manager = offload.current()
        stats = dict(manager.stats) if manager is not None else {}
    finally:
        offload.detach()
    losses = [h.get("lm loss") for h in history]
    return {"argv": argv, "losses": losses, "finite": all(l is not None and math.isfinite(l) for l in losses),
            "offloaded_bytes": stats.get("offloaded_bytes", 0), "dispatchers_replaced": moe.installed - before}


def section_train(size, claims) -> dict:
    extra = ["--mock-data", "--train-iters", "3", "--log-interval", "1", *size["train_extra"]]
    dense = run_train(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), *extra,
                       "--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                       "--activation-offload-min-tensor-kb", "1"])
    moe_run = run_train(["--recipe", os.path.join(ROOT, "recipes", "tiny_moe.yaml"), *extra,
                         "--moe-sync-free-dispatcher"])
    claim(claims, "train.py trains (finite losses) with activation offload on this platform's defaults",
          dense["finite"] and dense["offloaded_bytes"] > 0)
    claim(claims, "train.py trains the MoE recipe with the sync-free dispatcher",
          moe_run["finite"] and moe_run["dispatchers_replaced"] > 0)
    return {"status": "ok", "dense_offload": dense, "moe_sync_free": moe_run}
