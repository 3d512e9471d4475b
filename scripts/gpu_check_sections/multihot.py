"""multihot: indices_to_multihot against megatron-core's, syncs and time."""
from __future__ import annotations

import torch

from gpu_check_sections.common import NO_CUDA, claim, count_cuda_syncs, cuda, sync_free, timed_ms


def section_multihot(size, claims) -> dict:
    from megatron_ext import platform
    from megatron_ext.moe.multihot import indices_to_multihot, reference_indices_to_multihot
    from bench_dispatcher import bench_multihot

    device = platform.current().device
    rows = []
    for experts in size["multihot_experts"]:
        topk = min(8, experts) if experts > 8 else 2
        for tokens in size["multihot_tokens"]:
            bench = bench_multihot(tokens, topk, experts, size["multihot_reps"])
            gen = torch.Generator().manual_seed(tokens * 7 + experts)
            idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
            idx = idx.masked_fill(torch.rand(tokens, topk, generator=gen) < 0.3, -1).to(device)
            probs = torch.rand(tokens, topk, generator=gen).to(device)
            ref_map, ref_probs = reference_indices_to_multihot(idx, probs, experts)
            our_map, our_probs = indices_to_multihot(idx, probs, experts, out_dtype=torch.float32)
            equal = torch.equal(ref_map, our_map) and torch.equal(ref_probs.view(torch.int32), our_probs.view(torch.int32))
            t_ref = timed_ms(lambda: reference_indices_to_multihot(idx, probs, experts), size["multihot_reps"])
            t_ours = timed_ms(lambda: indices_to_multihot(idx, probs, experts), size["multihot_reps"])
            rows.append({
                "tokens": tokens, "experts": experts, "topk": topk,
                "bitwise_equal_at_shape": bool(equal),
                "bitwise_equal_random_cases": bench["bitwise_equal"],
                "syncs_detector_reference": bench["syncs_reference"], "syncs_detector_ours": bench["syncs_ours"],
                "cuda_syncs_reference": count_cuda_syncs(lambda: reference_indices_to_multihot(idx, probs, experts))[0],
                "cuda_sync_free_ours": sync_free(lambda: indices_to_multihot(idx, probs, experts)),
                "time_reference_ms": t_ref, "time_ours_ms": t_ours,
                "time_ours_over_reference": round(t_ours / t_ref, 3) if cuda() else NO_CUDA,
            })
    claim(claims, "indices_to_multihot is bit-identical to megatron-core's at every shape",
          all(r["bitwise_equal_at_shape"] and r["bitwise_equal_random_cases"] for r in rows))
    claim(claims, "indices_to_multihot: zero syncs (detector)", all(r["syncs_detector_ours"] == 0 for r in rows))
    claim(claims, "indices_to_multihot: zero syncs under set_sync_debug_mode('error')",
          all(r["cuda_sync_free_ours"] is True for r in rows) if cuda() else NO_CUDA)
    return {"status": "ok", "rows": rows}
