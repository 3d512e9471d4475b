"""transformer_engine: the transformer-engine spec trains with offload hooks; or why not."""
from __future__ import annotations

import os

from scripts.gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda, package_version
from scripts.gpu_check_sections.train_script import run_train


def section_transformer_engine(size, claims) -> dict:
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is the result
        claim(claims, "transformer-engine spec trains with offload hooks capturing bytes", "skipped: not importable")
        return {"status": f"skipped: transformer-engine not importable ({type(e).__name__}: {e})"}
    if not cuda():
        return {"status": NO_CUDA}
    run = run_train(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), "--mock-data", "--train-iters", "3",
                     "--log-interval", "1", "--transformer-impl", "transformer_engine", *size["train_extra"],
                     "--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                     "--activation-offload-min-tensor-kb", "1"])
    claim(claims, "transformer-engine spec trains with offload hooks capturing bytes",
          run["finite"] and run["offloaded_bytes"] > 0)
    return {"status": "ok", "version": package_version("transformer-engine"), **run}
