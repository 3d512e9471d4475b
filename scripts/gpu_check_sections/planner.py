"""planner: the predicted peak bytes against one measured training step."""
from __future__ import annotations

import os

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda


PLAN_CASES = (("dense", "tiny_dense.yaml", []),
              ("dense offload", "tiny_dense.yaml", ["--activation-offload-modules", "qkv_linear", "core_attention",
                                                    "attn_proj", "--activation-offload-min-tensor-kb", "1"]),
              ("moe", "tiny_moe.yaml", []),
              ("moe offload", "tiny_moe.yaml", ["--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                                                "router_fc1", "moe_act", "router_fc2", "--activation-offload-min-tensor-kb",
                                                "1"]))


def section_planner(size, claims) -> dict:
    from bench.plan import measure
    from megatron_ext.planner.search import Tracer

    rows = []
    tracers = {}  # offload does not change what the model saves: one trace per recipe
    for name, recipe, flags in (c for c in PLAN_CASES if c[0] in size["plan_cases"]):
        argv = ["--recipe", os.path.join(ROOT, "recipes", recipe), "--mock-data", *size["plan_extra"], *flags]
        r = measure(argv, tracers.setdefault(recipe, Tracer()))
        measured = sum(r["measured"].values())
        predicted = r["predicted"]["peak_bytes"]
        rows.append({"case": name, "predicted_peak_bytes": round(predicted), "measured_peak_bytes": measured,
                     "measured_by": "torch.cuda.max_memory_allocated" if cuda() else "live tensor bytes (CPU)",
                     "error": (predicted - measured) / measured, "megatron_estimate_bytes": round(r["megatron_estimate"]),
                     # what to read when a row misses: each component, predicted and measured, and where the
                     # predicted peak falls
                     "predicted_components": {k: round(v) for k, v in r["predicted"]["components"].items()},
                     "measured_components": r["measured"], "predicted_at": r["predicted"]["at"],
                     "offloaded_bytes": (r["offload_stats"] or {}).get("offloaded_bytes", 0)})
    within = all(abs(r["error"]) <= 0.05 for r in rows)
    claim(claims, "planner: predicted peak within 5 % of torch.cuda.max_memory_allocated (PP=1; dense and MoE, "
          "with and without offload)", within if cuda() else NO_CUDA)
    if not cuda():
        claim(claims, f"planner: predicted peak within 5 % of live tensor bytes on CPU (PP=1; {', '.join(r['case'] for r in rows)})",
              within)
    return {"status": "ok", "rows": rows}
