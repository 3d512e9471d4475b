"""A sync-free token dispatcher for megatron-core's MoELayer, built on :func:`indices_to_multihot`.

Same communication pattern as the upstream dispatcher it replaces (chosen by
``--moe-token-dispatcher-type``: ``alltoall`` or ``allgather``, over the same process groups), same
expert interface (SequentialMLP / grouped experts receive ``tokens, tokens_per_expert, probs``), and
the same outputs and gradients. What differs is where the host needs device values:

allgather (upstream: megatron/core/transformer/moe/token_dispatcher.py:230)
    Upstream all-gathers the ``[T, E]`` routing map and probs over TP x EP, then reads
    ``local_map.sum(0).cpu()`` (sync, :317) and ``masked_select``s the probs (sync, :328).
    Here each rank all-gathers top-k *indices* and probs ``[T, K]`` (K/E of the metadata), rebuilds
    its local ``[N, E_local]`` map with :func:`indices_to_multihot` (no sync) and permutes tokens and
    probs together with the fixed-shape argsort permute. Dropless: one device-to-host read of the
    per-expert counts (the experts need them as host split sizes). Capacity: none.

alltoall (upstream: token_dispatcher.py:372)
    Dropless, top-k <= 2, expert-TP 1 ("token-level", what DeepEP does): each token is sent once to
    every rank hosting one of its experts, with its top-k indices made local to that rank (-1
    elsewhere); the receiver expands them with :func:`indices_to_multihot` and permutes by local
    expert. A token with two experts on one rank crosses the wire once (upstream: twice). Split
    sizes and per-expert counts are read in one transfer. Other alltoall cases (top-k >= 3, where
    summing per rank first would re-associate the per-token sums; expert-TP > 1; capacity):
    rows are exchanged per (token, expert) pair exactly as upstream. After the all-to-all (and the
    TP all-gather) the rows arrive in ``[tp, ep, local expert]`` chunks; upstream sorts the chunks
    by local expert with ``torch.split(split_sizes.tolist())`` (moe_utils.py:607, host sizes). Here
    the local expert of every row is rebuilt on the device (``repeat_interleave`` *with*
    ``output_size``), turned into a ``[M, E_local]`` multihot map and permuted with the argsort
    permute: no host split sizes. Dropless: one batched device-to-host read (a2a split sizes and
    per-expert counts: variable sizes need them on the host). Capacity (with or without
    pad-to-capacity): every chunk has C rows, so the expert-major order is a fixed transpose (as
    upstream); fixed shapes everywhere, zero syncs (upstream syncs when it does not pad: the
    token count it reads at token_dispatcher.py:545 via the event at :950).

Padding to capacity is done here, not by the router: with ``--moe-expert-capacity-factor`` every
local expert gets exactly ``min(C, T) * TP * EP`` rows (``C`` = upstream ``get_capacity``), the
routed ones first, then rows with probability 0. Without ``--moe-pad-expert-input-to-capacity``
upstream processes only the routed rows, so outputs agree to rounding (padding rows add exact zeros,
but the blocking of the expert weight-gradient sums can differ); dropless and pad-to-capacity
agree bit for bit.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import List, Optional

import torch

from megatron.core.tensor_parallel import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_ext.moe.multihot import indices_to_multihot

_UP = SimpleNamespace(
    all_to_all=all_to_all,
    gather=gather_from_sequence_parallel_region,
    reduce_scatter=reduce_scatter_to_sequence_parallel_region,
    permute=moe_utils.permute,
    unpermute=moe_utils.unpermute,
    get_capacity=moe_utils.get_capacity,
)


def routing_map_to_indices(routing_map: torch.Tensor, probs: torch.Tensor, topk: int, capacity: bool):
    """``[T, E]`` bool map + probs -> top-k ``indices`` (-1 = none) and their ``probs``, ``[T, K]``.

    Fixed shapes, no sync. With a capacity factor the router's map may contain padding entries
    (probability exactly 0, moe_utils.py:1016); only real routings are kept, padding is re-created
    by the dispatcher."""
    key = routing_map & (probs != 0) if capacity else routing_map
    k = min(topk, key.shape[1])
    _, idx = torch.topk(key.to(torch.float32), k, dim=1)
    selected = key.gather(1, idx)
    indices = idx.masked_fill(~selected, -1)
    return indices, probs.gather(1, idx)


class MultihotTokenDispatcher(MoETokenDispatcher):
    """Drop-in for ``MoEAllGatherTokenDispatcher`` / ``MoEAlltoAllTokenDispatcher`` (megatron-core
    0.19.2). Construct it like them, or :meth:`replacing` an existing one."""

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.up = _UP
        self.comm = config.moe_token_dispatcher_type
        if self.comm not in ("alltoall", "allgather"):
            raise ValueError(f"multihot dispatcher: unsupported moe_token_dispatcher_type={self.comm!r}")
        if config.moe_permute_fusion or config.moe_router_padding_for_quantization:
            raise ValueError("multihot dispatcher: moe_permute_fusion / router padding are not supported")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.capacity_factor = config.moe_expert_capacity_factor
        # Token-level all-to-all where it keeps upstream's floating-point sums bit for bit:
        # dropless, no expert-TP reduce-scatter between the expert sums and the combine, and top-k
        # <= 2 (with 3+ experts per token, summing per rank first re-associates the per-token sum of
        # expert outputs, and of input gradients: c1 + (c2 + c3) vs (c1 + c2) + c3; measured ~1e-9).
        self.token_level = (
            self.comm == "alltoall" and self.capacity_factor is None and self.tp_size == 1 and self.topk <= 2
        )
        self.rows_sent = 0  # rows this rank put into the last dispatch all-to-all (tests, bench)
        self.cudagraph_attrs = []
        self.shared_experts = None

    @classmethod
    def replacing(cls, old) -> "MultihotTokenDispatcher":
        groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        new = cls(old.num_local_experts, old.local_expert_indices, old.config, pg_collection=groups)
        if getattr(old, "shared_experts", None) is not None:  # set by MoELayer under --moe-shared-expert-overlap
            new.set_shared_experts(old.shared_experts)
        return new

    def set_shared_experts(self, shared_experts):
        """--moe-shared-expert-overlap: the shared experts run on their side stream at the points of
        megatron's alltoall dispatcher (token_dispatcher.py:652, 693, 710, 854, 865-866, 898): gather
        before the dispatch, fc1 after the dispatch all-to-all, fc2 after the combine all-to-all, the
        output added at the end."""
        self.shared_experts = shared_experts

    # ------------------------------------------------------------------------------ helpers
    @property
    def _lo(self) -> int:
        return self.local_expert_indices[0]

    def _capacity(self, num_tokens: int) -> Optional[int]:
        """Rows per expert per source rank, or None when dropless. Host arithmetic only."""
        if self.capacity_factor is None:
            return None
        cap = self.up.get_capacity(
            num_tokens=num_tokens * self.topk, num_experts=self.num_experts, capacity_factor=self.capacity_factor
        )
        return min(cap, num_tokens)

    # ------------------------------------------------------------------------------ dispatch
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.num_tokens = hidden_states.shape[0]
        self.capacity = self._capacity(self.num_tokens)
        self.probs_dtype = probs.dtype
        if self.comm == "allgather":
            self.indices, probs = routing_map_to_indices(routing_map, probs, self.topk, self.capacity is not None)
            return hidden_states, probs
        if self.token_level:
            return self._token_preprocess(hidden_states, routing_map, probs)
        return self._a2a_preprocess(hidden_states, routing_map, probs)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
            hidden_states, probs = self._token_dispatch(hidden_states, probs)
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
            return hidden_states, probs
        return self._token_dispatch(hidden_states, probs)

    def _token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.comm == "allgather":
            if self.tp_size > 1 or self.ep_size > 1:
                with torch.no_grad():
                    self.indices = self.up.gather(self.indices, group=self.tp_ep_group)
                probs = self.up.gather(probs, group=self.tp_ep_group)
                hidden_states = self.up.gather(hidden_states, group=self.tp_ep_group)
            return hidden_states, probs
        if self.ep_size > 1:
            hidden_states = self.up.all_to_all(self.ep_group, hidden_states, self.output_splits, self.input_splits)
            probs = self.up.all_to_all(self.ep_group, probs, self.output_splits, self.input_splits)
            if self.token_level:
                with torch.no_grad():
                    self.indices = self.up.all_to_all(self.ep_group, self.indices, self.output_splits, self.input_splits)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.comm == "allgather" or self.token_level:
            return self._multihot_postprocess(hidden_states, probs)
        return self._a2a_postprocess(hidden_states, probs)

    # ------------------------------------------------------------------------------ combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        if self.local_sorted_indices is None:  # alltoall with capacity: undo the fixed transpose
            L, sources = self.num_local_experts, self.tp_size * self.ep_size
            hidden_states = (
                hidden_states.view(L, sources, self.capacity, -1).transpose(0, 1).reshape(self.local_shape)
            )
        else:
            hidden_states = self.up.unpermute(
                hidden_states, self.local_sorted_indices, restore_shape=self.local_shape
            )
        self.local_sorted_indices = None
        if self.comm == "alltoall" and self.tp_size > 1:
            hidden_states = self.up.reduce_scatter(
                hidden_states.to(self.probs_dtype), group=self.tp_group, input_split_sizes=self.output_splits_tp
            ).to(hidden_states.dtype)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor):
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
            hidden_states = self._token_combine(hidden_states)
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
            return hidden_states
        return self._token_combine(hidden_states)

    def _token_combine(self, hidden_states: torch.Tensor):
        if self.comm == "allgather":
            if self.tp_size > 1 or self.ep_size > 1:
                hidden_states = self.up.reduce_scatter(
                    hidden_states.to(self.probs_dtype), group=self.tp_ep_group
                ).to(hidden_states.dtype)
            return hidden_states
        if self.ep_size > 1:
            hidden_states = self.up.all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor):
        if self.token_level:  # sum each token's rows from every destination rank, in rank order
            hidden_states = self.up.unpermute(
                hidden_states, self.send_token_ids, restore_shape=(self.num_tokens, self.hidden_shape[-1])
            )
            self.send_token_ids = None
        elif self.comm == "alltoall":
            hidden_states = self.up.unpermute(
                hidden_states,
                self.sorted_indices,
                restore_shape=(self.num_tokens, self.hidden_shape[-1]),
                routing_map=self.routing_map,
                drop_and_pad=self.capacity is not None,
            )
            self.routing_map = None
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output

    # ------------------------------------------------------------------------------ allgather, token-level a2a
    def _multihot_postprocess(self, hidden_states, probs):
        """Received rows carry top-k expert indices [N, K] (-1 = none): multihot map of the local
        experts, then one permute of tokens and probs by local expert."""
        L, lo = self.num_local_experts, self._lo
        indices = self.indices
        if self.token_level:  # already local indices (the sender subtracted its offset)
            local = indices
        else:
            local = torch.where((indices >= lo) & (indices < lo + L), indices - lo, torch.full_like(indices, -1))
        local_map, local_probs = indices_to_multihot(local, probs, L)
        self.indices = None
        self.local_shape = hidden_states.shape
        if self.token_level:  # read with the split sizes, in the one transfer of _token_preprocess
            tokens_per_expert = self.tokens_per_local_expert
            num_out = sum(tokens_per_expert)
            drop_and_pad = False
        elif self.capacity is None:
            # The one unavoidable read: SequentialMLP splits by these counts on the host.
            tokens_per_expert = local_map.sum(dim=0).tolist()
            num_out = sum(tokens_per_expert)
            drop_and_pad = False
        else:
            per_expert = self.capacity * self.tp_size * self.ep_size
            tokens_per_expert = [per_expert] * L
            num_out = per_expert * L
            drop_and_pad = True
        permuted, permuted_probs, self.local_sorted_indices, _, _ = self.up.permute(
            hidden_states, local_map, probs=local_probs, num_out_tokens=num_out, drop_and_pad=drop_and_pad
        )
        return permuted, torch.tensor(tokens_per_expert, dtype=torch.long), permuted_probs

    # ------------------------------------------------------------------------------ alltoall
    def _token_preprocess(self, hidden_states, routing_map, probs):
        """Token-level all-to-all (dropless, expert-TP 1): each token goes once to each rank that
        hosts one of its experts, with its top-k indices made local to that rank (-1 elsewhere);
        the receiver expands it with indices_to_multihot. A token with several experts on one
        rank crosses the wire once, not once per expert (upstream's per-pair rows)."""
        T, E, L, ep = self.num_tokens, self.num_experts, self.num_local_experts, self.ep_size
        indices, probs = routing_map_to_indices(routing_map, probs, self.topk, capacity=False)
        rank_map = routing_map.view(T, ep, L).any(dim=2)  # [T, ep]: token t sends to rank r
        counts = torch.cat([rank_map.sum(dim=0), routing_map.sum(dim=0)]).long()  # [ep + E]
        if ep > 1:
            with torch.no_grad():
                gathered = self.up.gather(counts, group=self.ep_group).view(ep, ep + E)
        else:
            gathered = counts.view(1, ep + E)
        lo = self._lo
        meta = torch.cat([counts[:ep], gathered[:, self.ep_rank], gathered[:, ep + lo : ep + lo + L].sum(dim=0)])
        # The one unavoidable read in dropless mode (see _a2a_preprocess), one transfer.
        meta = meta.tolist()
        self.input_splits, self.output_splits = meta[:ep], meta[ep : 2 * ep]
        self.tokens_per_local_expert = meta[2 * ep :]
        num_send = self.rows_sent = sum(self.input_splits)
        # (rank, token) pairs, rank-major, tokens in order: fixed-size argsort, as moe_utils.permute
        flat = rank_map.T.reshape(-1).argsort(descending=True, stable=True)[:num_send]
        dest = flat // T
        self.send_token_ids = flat % T
        sent = indices.index_select(0, self.send_token_ids)
        local = sent - (dest * L).unsqueeze(1)
        self.indices = torch.where((sent >= 0) & (local >= 0) & (local < L), local, torch.full_like(local, -1))
        if ep == 1:
            self.input_splits = self.output_splits = None
        return hidden_states.index_select(0, self.send_token_ids), probs.index_select(0, self.send_token_ids)

    def _a2a_preprocess(self, hidden_states, routing_map, probs):
        E, L, lo = self.num_experts, self.num_local_experts, self._lo
        tp, ep = self.tp_size, self.ep_size
        self.routing_map = routing_map
        if self.capacity is not None:
            C = self.capacity
            self.input_splits = self.output_splits = self.output_splits_tp = None
            self.rows_per_chunk = None  # every (source rank, local expert) chunk has C rows
            self.tokens_per_local_expert = [C * tp * ep] * L
            num_out = self.rows_sent = C * E
        else:
            counts = routing_map.sum(dim=0).long()  # [E]
            if ep > 1 or tp > 1:
                with torch.no_grad():
                    gathered = self.up.gather(counts, group=self.tp_ep_group)
                # [ep, tp, E] -> [tp, ep, E], the same rank order as upstream (token_dispatcher.py:568)
                gathered = gathered.reshape(ep, tp, E).transpose(0, 1)
            else:
                gathered = counts.reshape(1, 1, E)
            chunk = gathered[:, :, lo : lo + L]  # [tp, ep, L]: rows each source sends to each local expert
            self.rows_per_chunk = chunk.reshape(-1)
            input_splits = counts.reshape(ep, L).sum(dim=1)
            meta = torch.cat([input_splits, chunk.sum(dim=2).reshape(-1), chunk.sum(dim=(0, 1))])
            # The one unavoidable read in dropless mode: all-to-all split sizes and per-expert row
            # counts are variable, and NCCL/gloo and the experts take them as host integers.
            meta = meta.tolist()
            self.input_splits = meta[:ep]
            per_rank = [meta[ep + i * ep : ep + (i + 1) * ep] for i in range(tp)]  # [tp][ep]
            self.output_splits = per_rank[self.tp_rank]
            self.output_splits_tp = [sum(r) for r in per_rank]
            self.tokens_per_local_expert = meta[ep + tp * ep :]
            num_out = self.rows_sent = sum(self.input_splits)  # = T*K unless a padding mask left rows unrouted
            if ep == 1 and tp == 1:
                self.input_splits = self.output_splits = self.output_splits_tp = None
        permuted, permuted_probs, self.sorted_indices, _, _ = self.up.permute(
            hidden_states,
            routing_map,
            probs=probs,
            num_out_tokens=num_out,
            drop_and_pad=self.capacity is not None,
        )
        return permuted, permuted_probs

    def _a2a_postprocess(self, hidden_states, probs):
        L, tp, ep = self.num_local_experts, self.tp_size, self.ep_size
        if tp > 1:
            hidden_states = self.up.gather(hidden_states, group=self.tp_group, output_split_sizes=self.output_splits_tp)
            probs = self.up.gather(probs, group=self.tp_group, output_split_sizes=self.output_splits_tp)
        rows = hidden_states.shape[0]
        self.local_shape = hidden_states.shape
        if self.capacity is not None:
            # Every (source, local expert) chunk has C rows: the expert-major order is a fixed
            # transpose ([tp*ep, L, C] -> [L, tp*ep, C]), no index computation needed.
            self.local_sorted_indices = None
            shape = (tp * ep, L, self.capacity)
            hidden_states = hidden_states.view(*shape, -1).transpose(0, 1).reshape(rows, -1)
            probs = probs.view(shape).transpose(0, 1).reshape(rows)
            return hidden_states, torch.tensor(self.tokens_per_local_expert, dtype=torch.long), probs
        # Local expert of every received row: chunks arrive as [tp][ep][local expert].
        labels = torch.arange(L, device=hidden_states.device).repeat(tp * ep)
        expert_of_row = labels.repeat_interleave(self.rows_per_chunk, output_size=rows)
        local_map, local_probs = indices_to_multihot(expert_of_row.unsqueeze(1), probs.unsqueeze(1), L)
        self.rows_per_chunk = None
        permuted, permuted_probs, self.local_sorted_indices, _, _ = self.up.permute(
            hidden_states, local_map, probs=local_probs, num_out_tokens=rows
        )
        return permuted, torch.tensor(self.tokens_per_local_expert, dtype=torch.long), permuted_probs
