"""Job functions for tests/training/test_context_parallel.py (every rank of a persistent gloo world)."""
from __future__ import annotations

import arguments


def train_grads(argv: list[str], grads: bool = True) -> dict:
    """The training loop on this rank: its logged losses and grad norms, and every parameter's last
    gradient (DDP's main_grad, reduced over data x context ranks) on rank 0 (the other ranks, or
    without ``grads``: {}; the sharded wrappers take their modules' parameters apart at teardown), as numpy arrays."""
    import torch

    from megatron_ext.seams import unwrapped
    from megatron_ext.training.run import Run

    built = []

    class Keep:  # the run's probe: the modules inside the DDP wrappers (emptied at teardown)
        def after_build(self, run):
            built.extend(unwrapped(c) for c in run.model)

    with Run.from_argv(list(argv), probes=[Keep()], parse=arguments.parse) as run:
        history = run.train()
    wanted, grads = grads, {}
    if wanted and torch.distributed.get_rank() == 0:
        for i, chunk in enumerate(built):
            for name, p in chunk.named_parameters():
                if getattr(p, "main_grad", None) is not None:
                    grads[f"{i}.{name}"] = p.main_grad.detach().float().numpy().copy()  # by value: a tensor
                    # would travel through a shared-memory file descriptor (a sharer thread per worker)
    built.clear()
    return dict(losses=[r["lm loss"] for r in history], grad_norms=[r["grad norm"] for r in history], grads=grads)


def train_grads_many(argvs: dict, document_tokens: int | None = None, grads: bool = True) -> dict:
    """train_grads for several runs in one job: {name: result}. ``document_tokens``: --mock-data's
    documents at most that long (megatron's are up to 4096 tokens), so that a sequence holds several
    and --eod-mask-loss takes a different number of tokens out of each CP rank's share."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    longest = MockGPTLowLevelDataset.max_sequence_length
    if document_tokens:
        MockGPTLowLevelDataset.max_sequence_length = document_tokens
    try:
        return {name: train_grads(list(argv), grads) for name, argv in argvs.items()}
    finally:
        MockGPTLowLevelDataset.max_sequence_length = longest
