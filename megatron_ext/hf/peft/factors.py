"""peft's factors <-> megatron's: stacked experts' factors cut into each expert's linear and back,
the layouts a family stacks them in (transposed, gate and up interleaved), the block-diagonal rank-2r form."""
from __future__ import annotations

import torch

from megatron_ext.hf.peft.sites import Stacked


def unstack(a: torch.Tensor, b: torch.Tensor, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """peft's A [r*E, x], B [y, r*E] -> each expert's (A_e [r, x], B_e [y, r])."""
    rank = a.shape[0] // experts
    a3, b3 = a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts)
    return [(a3[e], b3[:, :, e]) for e in range(experts)]


def stack(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.cat([p[0] for p in pairs], 0)
    b = torch.stack([p[1] for p in pairs], -1).flatten(1)
    return a.contiguous(), b.contiguous()


def to_linear(spec: Stacked, a_e, b_e, fc: int):
    """One expert's peft factors -> its megatron linear's (A [r, in], B [out, r]); fc1's B rows as
    megatron holds them ([gate; up])."""
    # peft's delta is B_e A_e in the parameter's layout when it swaps, its transpose otherwise; the
    # linear's weight is the parameter or its transpose
    if spec.peft_swaps == spec.transposed:
        a_e, b_e = b_e.t(), a_e.t()
    if fc == 1 and spec.halves == "interleave":
        b_e = torch.cat([b_e[0::2], b_e[1::2]], 0)
    return a_e.contiguous(), b_e.contiguous()


def from_linear(spec: Stacked, a, b, fc: int):
    if fc == 1 and spec.halves == "interleave":
        gate, up = b.chunk(2, 0)
        b = torch.stack([gate, up], 1).flatten(0, 1)
    if spec.peft_swaps == spec.transposed:
        a, b = b.t(), a.t()
    return a.contiguous(), b.contiguous()


def block_diagonal(a: torch.Tensor, b: torch.Tensor, rank: int):
    """A rank-2r fc1 adapter whose B is block-diagonal ([B_gate 0; 0 B_up]) -> its (gate, up) pairs,
    or None."""
    f = b.shape[0] // 2
    if a.shape[0] != 2 * rank or b[:f, rank:].any() or b[f:, :rank].any():
        return None
    return (a[:rank], b[:f, :rank]), (a[rank:], b[f:, rank:])


def inert(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not a.any() and not b.any()

