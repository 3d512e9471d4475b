"""Job functions for the offload tests (run on every rank of a gloo world).

The offload-off vs offload-on comparison itself (model build, megatron-core's schedules, bitwise
losses and grads, peak bytes, link settings of the CPU copy engine) is
``scripts/bench/offload.compare``, shared with the benchmark; these are the test-only jobs.
"""
from __future__ import annotations

import torch

from bench.offload import batches, build, offload_options
from megatron_ext.training import parallel


def _manual_step(chunks, c, before_backward=None):
    from torch.autograd import Variable

    for p in chunks[0].parameters():
        p.grad.zero_()
    b = batches(c, 0)[0]
    out = chunks[0](b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).float().mean()
    if before_backward is not None:
        before_backward()
    Variable._execution_engine.run_backward((out,), (torch.ones_like(out),), False, False, (),
                                            allow_unreachable=True, accumulate_grad=True)
    return {n: p.grad.clone() for n, p in chunks[0].named_parameters()}


def reload_in_flight():
    """A group whose D2H copy is still in flight when its reload is asked for (forced here, before
    any tick could release it). Ours: served from the device storage it still holds. With the fault
    'reload_in_flight' (upstream #7398's behaviour) the H2D reads pool slots the D2H has not filled."""
    from megatron_ext.offload import manager as om

    results = []
    for faults in ((), ("reload_in_flight",)):
        chunks, config, c = build(layers=2, microbatches=1)
        try:
            base = _manual_step(chunks, c)
            mgr = om.attach(chunks, offload_options(("core_attention", "qkv_linear", "attn_proj")))
            mgr._faults = set(faults)

            def force():
                g = mgr._pending
                mgr._pending = None
                mgr._offload(g)
                assert g.state == "offloading"
                mgr._reload(list(g.records.values()), g)

            got = _manual_step(chunks, c, force)
            results.append(dict(
                equal=all(torch.equal(base[k], got[k]) for k in base),
                nan=any(not torch.isfinite(v).all() for v in got.values()),
                served_in_flight_bytes=mgr.stats["served_in_flight_bytes"],
                reloaded_bytes=mgr.stats["reloaded_bytes"],
            ))
        finally:
            om.detach()
            parallel.destroy()
    return results


def train_losses(argv):
    """train.main on this rank; returns its per-iteration history (losses on the last PP stage)."""
    import train

    from megatron_ext import offload

    try:
        history = train.main(list(argv))
        mgr = offload.current()
        stats = dict(mgr.stats) if mgr is not None else None
    finally:
        offload.detach()
    return dict(history=history, stats=stats, pp_rank=None)


def train_explaining(argv: list[str]) -> dict:
    """train.main(argv): what it printed on this rank, and its offload manager's counters (what each
    listed module moved and kept on the device, by reason)."""
    import contextlib
    import io

    import train as entry
    from megatron_ext import offload

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        entry.main(argv)
    manager = offload.current()
    return {"stdout": out.getvalue(), "moved": manager.offloaded_by_module(), "kept": manager.kept_by_module,
            "kept_total": sum(v for k, v in manager.stats.items() if k.startswith("kept_"))}


def observed_not_offloaded(modules):
    """One step of a 2-layer dense model under an offload manager with an observer: what the observer
    was shown (per module: tensors and bytes), the manager's counters, and whether the gradients equal
    those of the step without a manager, bit for bit."""
    from megatron_ext.offload.manager import OffloadManager

    chunks, config, c = build(layers=2, microbatches=1)
    try:
        base = _manual_step(chunks, c)
        seen: dict = {}

        def observer(t, module):  # keeps no reference: an offload would be free to take the storage
            n, nbytes = seen.get(module, (0, 0))
            seen[module] = (n + 1, nbytes + t.untyped_storage().nbytes())

        mgr = OffloadManager(offload_options(modules), observer=observer).attach(chunks)
        try:
            got = _manual_step(chunks, c)
        finally:
            mgr.detach()
        return dict(equal=all(torch.equal(base[k], got[k]) for k in base), seen=seen, stats=dict(mgr.stats),
                    module_stats=mgr.module_stats, kept_by_module=mgr.kept_by_module,
                    pool_slots_taken=mgr.pool.high_water)
    finally:
        parallel.destroy()
