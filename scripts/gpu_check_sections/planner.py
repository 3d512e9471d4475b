"""planner: the predicted peak bytes against one measured training step."""
from __future__ import annotations

import os

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda


PLAN_CASES = (("dense", "tiny_dense.yaml", []),
              ("dense offload", "tiny_dense.yaml", ["--activation-offload-modules", "qkv_linear", "core_attention",
                                                    "attn_proj", "--activation-offload-min-tensor-kb", "1"]),
              ("moe", "tiny_moe.yaml", []))


def section_planner(size, claims) -> dict:
    from bench.plan import measure

    rows = []
    for name, recipe, flags in PLAN_CASES:
        argv = ["--recipe", os.path.join(ROOT, "recipes", recipe), "--mock-data", *size["plan_extra"], *flags]
        r = measure(argv)
        measured = sum(r["measured"].values())
        predicted = r["predicted"]["peak_bytes"]
        rows.append({"case": name, "predicted_peak_bytes": round(predicted), "measured_peak_bytes": measured,
                     "measured_by": "torch.cuda.max_memory_allocated" if cuda() else "live tensor bytes (CPU)",
                     "error": (predicted - measured) / measured, "megatron_estimate_bytes": round(r["megatron_estimate"])})
    within = all(abs(r["error"]) <= 0.05 for r in rows)
    claim(claims, "planner: predicted peak within 5 % of torch.cuda.max_memory_allocated (PP=1)",
          within if cuda() else NO_CUDA)
    if not cuda():
        claim(claims, "planner: predicted peak within 5 % of live tensor bytes on CPU (PP=1)", within)
    return {"status": "ok", "rows": rows}
