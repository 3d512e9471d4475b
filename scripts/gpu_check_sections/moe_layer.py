"""moe_layer: one MoELayer with megatron's and the sync-free dispatcher: syncs, agreement, time."""
from __future__ import annotations

import torch

from gpu_check_sections.common import NO_CUDA, claim, count_cuda_syncs, cuda, sync_free, timed_ms


def cuda_graph_replays(layer, x, x_other) -> bool | str:
    """Capture ``layer``'s forward (no grad) in a CUDA graph, replay it on another input (another
    routing) copied into the captured one, and compare with the eager output bit for bit."""
    if not cuda():
        return NO_CUDA
    try:
        with torch.no_grad():
            static_x = x.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the capture (allocator, lazy state)
                    layer(static_x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = layer(static_x)[0]
            static_x.copy_(x_other)
            graph.replay()
            torch.cuda.synchronize()
            return bool(torch.equal(static_out, layer(x_other)[0]))
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def section_moe_layer(size, claims) -> dict:
    from megatron_ext import seams
    from megatron_ext.moe import audit
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.training import parallel

    rows = []
    parallel.initialize()
    try:
        for layer_cfg in size["layers"]:
            for dispatcher in ("alltoall", "allgather"):
                for mode in audit.MODES:
                    spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, experts=layer_cfg["experts"],
                                           topk=layer_cfg["topk"], hidden=layer_cfg["hidden"], ffn=layer_cfg["ffn"])
                    x, g = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=1)
                    runs = {}
                    for ours in (False, True):
                        seams.reset_moe_aux_loss_scale()
                        layer = audit.build_layer(spec, seed=1, ours=ours)
                        runs[ours] = run = audit.run_layer(layer, x, g)

                        def forward(layer=layer):
                            return layer(x.clone().requires_grad_(True))[0]

                        def step(layer=layer):
                            run_backward(forward(), g)

                        syncs_fwd, out = count_cuda_syncs(forward)
                        syncs_bwd, _ = count_cuda_syncs(lambda out=out: run_backward(out, g))
                        del out
                        claimed = ours and mode != "dropless"  # the paths claimed to run with no sync
                        graph = "-"
                        if ours and mode in ("capacity", "dropless-syncfree"):
                            x_other, _ = audit.rank_inputs(spec, seq=layer_cfg["seq"], batch=2, seed=2)
                            graph = cuda_graph_replays(layer, x, x_other)
                        rows.append({
                            "layer": layer_cfg["name"], "tokens": layer_cfg["seq"] * 2,
                            "dispatcher": ("multihot-" if ours else "megatron-") + dispatcher, "mode": mode,
                            "syncs_forward": run.syncs_forward, "syncs_backward": run.syncs_backward,
                            "cuda_syncs_forward": syncs_fwd, "cuda_syncs_backward": syncs_bwd,
                            "cuda_sync_free_step": sync_free(step) if claimed else "-",
                            "cuda_graph_replay_bitwise": graph,
                            "step_ms": timed_ms(step, size["layer_reps"]),
                        })
                        del layer
                    ref, got = runs[False], runs[True]
                    rows[-1]["bitwise_equal_to_megatron"] = bool(
                        torch.equal(ref.out, got.out) and torch.equal(ref.dx, got.dx)
                        and all(torch.equal(ref.dw[k], got.dw[k]) for k in ref.dw))
                    rows[-1]["max_abs_diff_to_megatron"] = max(
                        [(ref.out - got.out).abs().max().item(), (ref.dx - got.dx).abs().max().item()]
                        + [(ref.dw[k] - got.dw[k]).abs().max().item() for k in ref.dw])
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()
    ours = [r for r in rows if r["dispatcher"].startswith("multihot")]
    capacity = [r for r in ours if r["mode"] != "dropless"]
    claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes: zero syncs forward and backward "
          "(detector)", all(r["syncs_forward"] == 0 and r["syncs_backward"] == 0 for r in capacity))
    claim(claims, "zero-sync dropless MoE layer: captured in a CUDA graph, replayed on another routing, "
          "equal to eager", all(r["cuda_graph_replay_bitwise"] is True for r in ours if r["mode"] == "dropless-syncfree")
          if cuda() else NO_CUDA)
    claim(claims, "sync-free dispatcher, capacity and zero-sync dropless modes: zero syncs under "
          "set_sync_debug_mode('error')",
          all(r["cuda_sync_free_step"] is True and r["cuda_syncs_forward"] == r["cuda_syncs_backward"] == 0
               for r in capacity) if cuda() else NO_CUDA)
    claim(claims, "sync-free dispatcher, dropless: one sync per layer forward (the split sizes)",
          all(r["syncs_forward"] + r["syncs_backward"] == 1 for r in ours if r["mode"] == "dropless"))
    claim(claims, "sync-free dispatcher: bit-identical to megatron's where it claims to be (dropless, capacity, "
          "zero-sync dropless)",
          all(r["bitwise_equal_to_megatron"] for r in ours if r["mode"] != "capacity-nopad"))
    return {"status": "ok", "rows": rows}
