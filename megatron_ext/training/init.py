"""Layout-invariant initialisation: every parameter drawn from its *global* checkpoint key.

megatron-core's sharded_state_dict names each parameter by its global key, global shape and this
rank's offset in it, for any TP / PP / VPP / EP / DP layout. Drawing the full tensor from a seed
derived from the key and keeping this rank's slice gives every layout the same starting weights,
so layouts can be compared step by step (and a TP=2 run equals a single-process run).
"""
from __future__ import annotations

import zlib

import torch

from megatron_ext.checkpoint import sharded_tensors


def _full_tensor(key: str, shape, std: float, seed: int) -> torch.Tensor:
    """Row i depends only on (key, i, seed), so a vocab padded to another size keeps its rows."""
    if len(shape) == 1:
        return torch.ones(shape) if key.endswith("weight") else torch.zeros(shape)
    base = seed * 1_000_003 + zlib.crc32(key.encode())
    rows = [
        torch.randn(tuple(shape[1:]), generator=torch.Generator().manual_seed(base + i)) for i in range(shape[0])
    ]
    return torch.stack(rows) * std


def _local_slice(full: torch.Tensor, sh) -> torch.Tensor:
    index = []
    for axis, offset in enumerate(sh.global_offset):
        local = axis - sh.prepend_axis_num
        length = 1 if local < 0 else sh.data.shape[local]
        index.append(slice(offset, offset + length))
    return full[tuple(index)].reshape(sh.data.shape)


@torch.no_grad()
def layout_invariant_init(model_chunks: list, std: float, seed: int) -> int:
    """Overwrite every parameter of the (unwrapped) chunks; returns how many tensors were set."""
    from megatron_ext.seams import unwrapped

    count = 0
    for chunk in model_chunks:
        for sh in sharded_tensors(unwrapped(chunk).sharded_state_dict()):
            if sh.data is None or not sh.data.is_floating_point() or "_extra_state" in sh.key:
                continue
            full = _full_tensor(sh.key, sh.global_shape, std, seed)
            sh.data.copy_(_local_slice(full, sh).to(sh.data.dtype))
            count += 1
    return count
