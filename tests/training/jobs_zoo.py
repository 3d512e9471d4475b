"""Job functions for the model-zoo test (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import hashlib

import arguments


def _digest(t) -> str:
    import torch

    return hashlib.sha1(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def train_digest(argv: list[str]) -> dict:
    """The training loop on this rank (megatron_ext/training/run.py); its log history, and a hash of every parameter and of its last
    gradient (DDP's main_grad) after training: equal hashes = bit-identical weights and gradients."""
    from megatron_ext import offload
    from megatron_ext.seams import unwrapped
    from megatron_ext.training.run import Run

    built = []

    class Keep:  # the run's probe: the modules inside the DDP wrappers (emptied at teardown)
        def after_build(self, run):
            built.extend(unwrapped(c) for c in run.model)

    try:
        with Run.from_argv(list(argv), probes=[Keep()], parse=arguments.parse) as run:
            history = run.train()
        mgr = offload.current()
        by_module = {f"{m}/{path}": dict(v) for (m, path), v in mgr.module_stats.items()} if mgr else {}
    finally:
        offload.detach()
    params, grads = {}, {}
    for i, chunk in enumerate(built):
        for name, p in chunk.named_parameters():
            params[f"{i}.{name}"] = _digest(p)
            if getattr(p, "main_grad", None) is not None:
                grads[f"{i}.{name}"] = _digest(p.main_grad)
    built.clear()
    return dict(history=history, params=params, grads=grads, offloaded=by_module)


def train_digests(argvs: dict) -> dict:
    """train_digest for several runs in one job (one pool, one start-up): {name: digest}."""
    return {name: train_digest(list(argv)) for name, argv in argvs.items()}


def train_digests_without_state_swap(argvs: dict) -> dict:
    """Negative control: train_digests with the overlap's per-pass swap of the stateful modules'
    attributes (schedules/lane_state.py set_stateful) turned off; a run that raises gives its error.
    The ranks whose pipeline peers stopped at the error wait for them as on NCCL; the faithful
    mode's p2p reports that after 2 s here instead of its default minute. (Early enough to be
    wrong only for the waiting ranks: the ranks that raise are computing, not waiting, then.)"""
    from megatron_ext.platform import nccl_p2p
    from megatron_ext.schedules import lane_state

    snapshot, restore, patience = lane_state.state_snapshot, lane_state.state_restore, nccl_p2p.DEADLOCK_S
    lane_state.state_snapshot, lane_state.state_restore = (lambda: []), (lambda state: None)
    nccl_p2p.DEADLOCK_S = 2.0
    try:
        out = {}
        for name, argv in argvs.items():
            try:
                out[name] = train_digest(list(argv))
            except Exception as e:  # noqa: BLE001 - the failure is the result
                out[name] = {"error": f"{type(e).__name__}: {e}"}
        return out
    finally:
        lane_state.state_snapshot, lane_state.state_restore, nccl_p2p.DEADLOCK_S = snapshot, restore, patience
