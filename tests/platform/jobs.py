"""Distributed probes of the CPU shims that only a collective can exercise."""
from __future__ import annotations

import torch


def _group():
    from megatron.core import parallel_state

    from megatron_ext.training import parallel

    parallel.initialize(tensor=2)
    return parallel_state.get_tensor_model_parallel_group()


def uneven_gather(without_shim: bool):
    """mappings.py:154 — all_gather into uneven splits (rank r contributes r+1 rows)."""
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    from megatron_ext.platform import cpu_shims

    group = _group()
    rank = torch.distributed.get_rank(group)
    x = torch.full((rank + 1, 3), float(rank + 1))
    with cpu_shims.without("uneven_collectives") if without_shim else _nothing():
        try:
            out = _gather_along_first_dim(x, group, output_split_sizes=[1, 2])
        except Exception as e:  # noqa: BLE001 - the probe reports what gloo said
            return f"error: {type(e).__name__}: {e}"
    return out.tolist()


def host_split_sizes(without_shim: bool):
    """moe_utils.py:1184 — on CPU the alltoall split sizes stay tensors; the dispatcher
    (token_dispatcher.py:930-933) hands what maybe_move_tensor_to_cpu returns to all_to_all."""
    from megatron.core.tensor_parallel.mappings import all_to_all
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_ext.platform import cpu_shims

    group = _group()
    rank = torch.distributed.get_rank(group)
    x = torch.full((2, 2), float(rank))
    with cpu_shims.without("host_split_sizes") if without_shim else _nothing():
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 1]), as_numpy=True)
        try:
            out = all_to_all(group, x, splits, splits)
        except Exception as e:  # noqa: BLE001
            return f"error: {type(e).__name__}: {e}"
    return out.tolist()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
