"""Sync-free conversion of top-k expert indices to a multihot routing map.

Same contract as megatron-core's ``_DeepepManager._indices_to_multihot``
(megatron/core/transformer/moe/token_dispatcher.py:1328): ``indices`` is ``[T, K]`` integer with
``-1`` meaning "masked"; the result is a bool routing map ``[T, E]`` and the probabilities scattered
into ``[T, E]`` (zero where not routed).

The upstream version syncs three times on CUDA: ``indices[mask]`` and ``probs[mask]`` (boolean-mask
gathers, data-dependent output size) and ``repeat_interleave(mask.sum(1))`` without ``output_size``.
This one uses only fixed-shape ops: every (row, k) pair gets a flat destination ``row * E + index``;
masked pairs all go to one spare slot ``T * E`` at the end of a flat buffer of ``T * E + 1``
elements, which is never part of the returned ``[T, E]`` view. ``scatter_`` then *copies* each
probability into place, so every output element is bit-identical to the reference (also -0.0 and
NaN payloads; an arithmetic formulation such as one-hot x probs would not be).

Inputs must be what top-k produces: within a row the valid indices are distinct. With duplicate
valid indices the reference itself is undefined on CUDA (index_put_ without accumulate).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def indices_to_multihot(
    indices: torch.Tensor,
    probs: torch.Tensor,
    num_experts: int,
    out_dtype: Optional[torch.dtype] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map bool [T, E], multihot_probs [T, E])`` from ``indices``/``probs`` ``[T, K]``.

    ``out_dtype`` defaults to ``probs.dtype``. The upstream function always returns float32 (the
    DeepEP path feeds it float32 probs only, see token_dispatcher.py:1309); pass
    ``out_dtype=torch.float32`` for its exact output with any input dtype.

    No host-device synchronisation, no data-dependent shapes, no fused kernels: CUDA-graph safe.
    """
    if indices.dim() != 2 or probs.shape != indices.shape:
        raise ValueError(f"indices {tuple(indices.shape)} and probs {tuple(probs.shape)} must be [T, K]")
    num_tokens = indices.shape[0]
    out_dtype = probs.dtype if out_dtype is None else out_dtype
    device = indices.device
    flat_size = num_tokens * num_experts
    spare = flat_size  # one write-only slot that collects every masked (row, k)

    idx = indices.long()
    rows = torch.arange(num_tokens, device=device, dtype=torch.long).unsqueeze(1) * num_experts
    flat = torch.where(idx != -1, rows + idx, spare).reshape(-1)

    routing = torch.zeros(flat_size + 1, dtype=torch.bool, device=device)
    routing.scatter_(0, flat, True)
    multihot_probs = torch.zeros(flat_size + 1, dtype=out_dtype, device=device)
    multihot_probs.scatter_(0, flat, probs.reshape(-1).to(out_dtype))
    # Leading T*E elements: a contiguous view, storage offset 0, exactly [T, E].
    return routing[:flat_size].view(num_tokens, num_experts), multihot_probs[:flat_size].view(
        num_tokens, num_experts
    )


def reference_indices_to_multihot(indices: torch.Tensor, probs: torch.Tensor, num_experts: int):
    """megatron-core's own ``_DeepepManager._indices_to_multihot``, called unbound (it reads only
    ``self.num_local_experts``), so tests and the benchmark compare against the installed code."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.token_dispatcher import _DeepepManager

    return _DeepepManager._indices_to_multihot(SimpleNamespace(num_local_experts=num_experts), indices, probs)
