"""Job functions for tests/dist.py workers (every rank runs them in an initialised gloo world)."""
from __future__ import annotations

import torch

from megatron_ext import seams
from megatron_ext.moe import audit


def layer_equivalence(dispatcher="alltoall", mode="dropless", ep=2, tp=1, etp=None, experts=4, topk=2,
                      seq=16, batch=2, hidden=32, seed=7, padded_tail=0, budget_factor=None, shared_expert=False,
                      routing=(), dtype="float32"):
    """Standard vs multihot dispatcher on one MoELayer: outputs, input grads, weight grads and the
    syncs each one causes (forward / backward) on this rank. ``mode="dropless-syncfree"``: also the
    budget, the pairs it dropped (device counters) and which output rows still equal upstream's."""
    from megatron_ext.moe.fixed_dispatch import OVERFLOW
    from megatron_ext.training import parallel

    parallel.initialize(tensor=tp, expert=ep, expert_tensor=etp)
    seams.reset_moe_aux_loss_scale()
    try:
        spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, experts=experts, topk=topk,
                               hidden=hidden, tp=tp, ep=ep, etp=etp, budget_factor=budget_factor,
                               shared_expert=shared_expert, routing=tuple(routing), dtype=dtype)
        x, g = audit.rank_inputs(spec, seq=seq, batch=batch, seed=seed)
        mask = None
        if padded_tail:  # the last `padded_tail` positions of this rank's sequence are padding
            mask = torch.zeros(batch, x.shape[0], dtype=torch.bool, device=x.device)
            mask[:, -padded_tail:] = True
        ref_layer = audit.build_layer(spec, seed=seed, ours=False)
        ref = audit.run_layer(ref_layer, x, g, padding_mask=mask)
        # (token, expert) rows upstream's alltoall sends: its input splits
        splits = getattr(ref_layer.token_dispatcher, "input_splits", None)
        ref_pairs = sum(int(v) for v in splits) if splits is not None else -1
        seams.reset_moe_aux_loss_scale()
        layer = audit.build_layer(spec, seed=seed, ours=True)
        OVERFLOW.reset()
        ours = audit.run_layer(layer, x, g, padding_mask=mask)
        dropped, load = OVERFLOW.take()
        dispatcher_ = layer.token_dispatcher
        lost = getattr(dispatcher_, "tokens_dropped", None)
        row_diff = (ref.out - ours.out).abs().amax(dim=-1).reshape(-1)  # [s, b, h] -> per token (s-major)
        return {
            "out_equal": torch.equal(ref.out, ours.out),
            "dx_equal": torch.equal(ref.dx, ours.dx),
            "dw_equal": all(torch.equal(ref.dw[k], ours.dw[k]) for k in ref.dw),
            "max_abs_diff": max(
                [(ref.out - ours.out).abs().max().item(), (ref.dx - ours.dx).abs().max().item()]
                + [(ref.dw[k] - ours.dw[k]).abs().max().item() for k in ref.dw]
            ),
            "same_keys": sorted(ref.dw) == sorted(ours.dw),
            "dw_differ": [k for k in ref.dw if not torch.equal(ref.dw[k], ours.dw[k])],
            "syncs_reference": (ref.syncs_forward, ref.syncs_backward),
            "syncs_ours": (ours.syncs_forward, ours.syncs_backward),
            "sites_ours": ours.sites,
            "sites_reference": ref.sites,
            "replaced": ours.replaced,
            "token_level": getattr(dispatcher_, "token_level", None),
            "rows_sent": getattr(dispatcher_, "rows_sent", None),
            "pairs": int(ref_pairs),
            "budget": getattr(dispatcher_, "budget", None),
            "dropped": None if dropped is None else int(dropped.sum()),
            "load": None if load is None else float(load.max()),
            "lost_tokens": None if lost is None else lost.tolist(),
            "row_diff": row_diff.tolist(),
        }
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()


def train(argv):
    """train.main under this world; returns the loss history and how many dispatchers were swapped."""
    import train as entry

    from megatron_ext import moe

    before = moe.installed
    seams.reset_moe_aux_loss_scale()
    try:
        history = entry.main(list(argv))
    finally:
        seams.reset_moe_aux_loss_scale()
    return {"history": history, "installed": moe.installed - before}


def shape_trace(dispatcher="alltoall", mode="capacity", ep=2, tp=1, ours=True, seed=11, whole=False,
                dtype="float32"):
    """Run one layer (``whole``: the transformer layer around it) twice on inputs with different
    routings; are the op/shape traces identical?"""
    from megatron_ext.training import parallel

    parallel.initialize(tensor=tp, expert=ep)
    seams.reset_moe_aux_loss_scale()
    try:
        spec = audit.LayerSpec(dispatcher=dispatcher, mode=mode, tp=tp, ep=ep, dtype=dtype)
        layer = audit.build_layer(spec, seed=seed, ours=ours, whole=whole)
        traces = []
        audit.trace_layer(layer, *audit.rank_inputs(spec, seed=seed * 10))  # warm-up
        for s in (1, 2):
            x, g = audit.rank_inputs(spec, seed=seed * 10 + s)
            traces.append(audit.trace_layer(layer, x, g))
        return {"same": traces[0] == traces[1], "ops": len(traces[0])}
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()


def sync_audit(ep=1, old_grouped_experts=None):
    """The CPU audit on this rank (megatron_ext/moe/audit.py), EP ``ep``: every mode claimed sync-free
    (bf16), the whole transformer layer around the zero-sync MoE layer (what a CUDA graph captures), and
    the negative controls: fp32 zero-sync (torch's grouped-GEMM fallback), the one-sync dropless mode
    (a host read), and, given its source, the grouped experts of an older tree (a host 0-dim tensor)."""
    import types

    from megatron_ext.training import parallel

    parallel.initialize(expert=ep)
    try:
        zero_sync = tuple((d, "dropless-syncfree") for d in audit.DISPATCHERS)
        out = {
            "sync_free": audit.audit_sync_free(ep=ep),
            "whole_layer": audit.audit_sync_free(ep=ep, modes=zero_sync, whole=True),
            "fp32_zero_sync": audit.audit_sync_free(ep=ep, dtype="float32", modes=zero_sync[:1]),
            "one_sync_dropless": audit.audit_sync_free(ep=ep, modes=(("alltoall", "dropless"),)),
        }
        if old_grouped_experts is not None:
            old = types.ModuleType("grouped_experts_old")
            old.__file__ = "grouped_experts@4d4d546.py"
            exec(compile(old_grouped_experts, old.__file__, "exec"), old.__dict__)
            out["old_grouped_experts"] = audit.audit_sync_free(ep=ep, modes=zero_sync, grouped=old)
        return out
    finally:
        seams.reset_moe_aux_loss_scale()
        parallel.destroy()
