"""Distributed jobs for tests/seams/test_fsdp_fetch.py (2 ranks, DP2, EP1)."""
from __future__ import annotations

import torch


def _run_steps(experts: int, ours: bool, steps: int = 2) -> dict:
    """Megatron-FSDP (optim_grads_params) on a stack of MoE layers: `steps` forward + backward +
    gradient syncs with an update of the sharded weights in between, so each fetch after the first
    gathers new values into the bucket whose views the seam keeps. Returns every observable."""
    from megatron_ext import platform
    from bench import fsdp as bench
    from megatron_ext.seams import fsdp_fetch
    from megatron_ext.training import parallel

    c = dict(bench.DEFAULTS)
    parallel.initialize(seed=c["seed"])
    model = None
    try:
        stack, config = bench.build_stack(experts, c)
        gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        device = platform.current().device
        out: dict = {"out": [], "dx": [], "grads": [], "optimizer_grads": [], "weights": []}
        with fsdp_fetch.applied() if ours else fsdp_fetch.removed():
            model = bench.wrap(stack, config, "megatron_fsdp")
            out["unit_hooks"] = (getattr(model.module, "_ext_unit_hooks", False),
                                 getattr(model.module, "_ext_units_released_per_bucket", 0))
            groups = model.param_and_grad_buffer.parameter_groups
            for _ in range(steps):
                model.zero_grad_buffer()
                for _ in range(2):  # two micro-batches: gradients accumulate in the shards
                    x = torch.randn(c["seq"], c["mbs"], c["hidden"], generator=gen).to(device).requires_grad_(True)
                    g = torch.randn(c["seq"], c["mbs"], c["hidden"], generator=gen).to(device)
                    y = model(x)
                    y.backward(g)
                    out["out"].append(y.detach().clone())
                    out["dx"].append(x.grad.clone())
                model.finish_grad_sync()
                out["grads"].append([grp.main_grad_buffer.data.clone() for grp in groups])
                # What the optimizer sees: each parameter's .grad (a DTensor over its shard).
                out["optimizer_grads"].append([
                    p.grad.to_local().clone() if p.grad is not None else torch.empty(0)
                    for _, p in model.param_and_grad_buffer.optimizer_named_parameters
                ])
                with torch.no_grad():  # a plain SGD step on the shards the next fetch gathers
                    for grp in groups:
                        w, gr = grp.model_weight_buffer.data, grp.main_grad_buffer.data
                        w.add_(gr[: w.numel()], alpha=-0.1) if gr.numel() >= w.numel() else w.mul_(0.9)
                out["weights"].append([grp.model_weight_buffer.data.clone() for grp in groups])
        return out
    finally:
        if model is not None:
            bench.release(model, "megatron_fsdp")
        parallel.destroy()


def fsdp_fetch_bitwise_and_counts(experts=(4, 8)) -> dict:
    from bench.fsdp import measure

    stock = _run_steps(experts[-1], ours=False)
    ours = _run_steps(experts[-1], ours=True)
    same = {k: all(torch.equal(a, b) if isinstance(a, torch.Tensor) else all(map(torch.equal, a, b))
                   for a, b in zip(stock[k], ours[k])) for k in stock if k != "unit_hooks"}
    changed = not torch.equal(stock["out"][0], stock["out"][2])  # step 1 vs step 2, first micro-batch
    counts = [measure(e, wrapper="megatron_fsdp", ours=o, timed=1) for e in experts for o in (False, True)]
    return {"same": same, "outputs_differ_between_steps": changed, "counts": counts,
            "unit_hooks": (stock["unit_hooks"], ours["unit_hooks"])}


def train_with_and_without(argv: list[str]) -> dict:
    """train.py's own run with --use-megatron-fsdp twice: megatron-core's code, then with the
    fsdp_fetch seams the run installs (for_run). Per-iteration loss and grad norm of both."""
    import train as entry

    from megatron_ext.seams import fsdp_fetch

    def history():
        return [(r["lm loss"], r.get("grad norm")) for r in entry.main(list(argv))]

    for_run, apply = fsdp_fetch.for_run, fsdp_fetch._unit_hooks_apply
    fsdp_fetch.for_run = lambda args: []
    try:
        stock = history()
    finally:
        fsdp_fetch.for_run = for_run
    applied = []  # per model built: did the unit hooks take over (the plain configuration)?
    fsdp_fetch._unit_hooks_apply = lambda *a: applied.append(apply(*a)) or applied[-1]
    try:
        ours = history()
    finally:
        fsdp_fetch._unit_hooks_apply = apply
    return {"stock": stock, "ours": ours, "unit_hooks": applied}
