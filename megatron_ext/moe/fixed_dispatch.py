"""Dropless MoE dispatch with no host synchronisation: fixed-size buffers, device-side expert offsets.

The sync-free dispatcher's dropless mode reads one thing on the host: variable all-to-all split
sizes and per-expert row counts. Here nothing variable reaches the host:

* every shape is fixed by host arithmetic from the token count: a **budget** of rows per
  destination rank (alltoall) or per rank's local experts (allgather). The worst case (the
  default) is ``tokens x min(top-k, local experts)``: no routing can exceed it, so nothing is ever
  dropped. ``--moe-dropless-budget-factor F`` sizes it at ``F x`` the balanced load instead
  (``tokens x top-k / EP``), capped at the worst case;
* the all-to-all exchanges equal, fixed splits (``all_to_all_single`` without split lists) of
  ``[EP, budget]`` rows, plus the ``[EP, local experts]`` row counts as a tensor;
* the receiver orders rows by local expert on the device (``searchsorted`` over the counts, one
  ``index_copy``), in upstream's order (expert, then source rank [tp][ep], then token);
* the experts run as grouped GEMMs over device offsets (:mod:`megatron_ext.moe.grouped_experts`);
* combine reverses both steps; pairs past the budget, and padding rows, contribute exact zeros.

A routing that needs more rows than the budget drops the pairs past it (the last ones in expert
order of that destination), counts them on the device (:data:`OVERFLOW`) and the counts are read
at the next log line (the only host read); ``--moe-dropless-overflow error`` then stops the run.
When nothing overflows, the rows each expert sees, their order, and every product are the ones of
megatron's standard dropless dispatcher, so outputs and gradients are bit-identical.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_ext.moe.dispatcher import MultihotTokenDispatcher
from megatron_ext.moe.multihot import indices_to_multihot


class OverflowCounter:
    """Device-side totals of one process: pairs dropped past a budget, and the largest load seen
    relative to the balanced one (what factor would have fitted). Read only at log time. Updated in
    place in buffers made at the first dispatch, so a captured CUDA graph that replays the dispatch
    keeps counting (a tensor made at capture would be left behind by the next replay); megatron's
    graph warmup passes are not counted."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.dropped: Optional[torch.Tensor] = None
        self.load: Optional[torch.Tensor] = None  # max rows needed / balanced rows
        self.budget_factor: Optional[float] = None  # of the last dispatch, for messages

    def add(self, dropped: torch.Tensor, needed: torch.Tensor, balanced: float) -> None:
        from megatron_ext.seams import moe as moe_seams

        if moe_seams.in_graph_warmup():
            return
        with torch.no_grad():
            dropped = dropped.detach().to(torch.int64).reshape(1)
            load = needed.detach().to(torch.float64).reshape(1) / balanced
            if self.dropped is None:
                self.dropped, self.load = dropped.clone(), load.clone()
            else:
                self.dropped.add_(dropped)
                torch.maximum(self.load, load, out=self.load)

    def take(self):
        """(dropped, max load) since the last call, as device tensors ([1] each), and zero the totals;
        (None, None) before any dispatch."""
        if self.dropped is None:
            return None, None
        with torch.no_grad():
            dropped, load = self.dropped.clone(), self.load.clone()
            self.dropped.zero_()
            self.load.zero_()
        return dropped, load


OVERFLOW = OverflowCounter()


def budget_rows(tokens: int, topk: int, num_experts: int, num_local: int,
                factor: Optional[float], rows_per_token: Optional[float] = None) -> tuple[int, float]:
    """(rows, balanced rows) of the buffer of ``tokens`` for one rank's ``num_local`` experts; with
    ``rows_per_token``, that many rows per token instead (the planner's trace sizes its buffers as the
    run it models does). Host arithmetic only."""
    worst = tokens * min(topk, num_local)
    balanced = tokens * topk * num_local / num_experts
    if rows_per_token is not None:
        return max(1, math.ceil(rows_per_token * tokens)), balanced
    if factor is None:
        return max(worst, 1), balanced
    return max(1, min(worst, math.ceil(factor * balanced))), balanced


class FixedBudgetDispatcher(MultihotTokenDispatcher):
    """The sync-free dispatcher in dropless mode with zero host syncs. Experts must be the grouped
    SequentialMLP path (``tokens_per_expert`` is a device tensor)."""

    def __init__(self, *a, budget_factor: Optional[float] = None, **k):
        super().__init__(*a, **k)
        if self.capacity_factor is not None:
            raise ValueError("fixed-budget dispatch is the dropless mode (no capacity factor)")
        self.token_level = False  # per-pair rows, in upstream's order
        self.budget_factor = budget_factor
        self.rows_per_token = None  # buffers sized per token instead of by the factor (moe.size_buffers)
        self.budget = None  # rows of the last dispatch's buffer (tests, bench)

    @classmethod
    def replacing(cls, old, budget_factor: Optional[float] = None) -> "FixedBudgetDispatcher":
        from types import SimpleNamespace

        groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        new = cls(old.num_local_experts, old.local_expert_indices, old.config, pg_collection=groups,
                  budget_factor=budget_factor)
        if getattr(old, "shared_experts", None) is not None:
            new.set_shared_experts(old.shared_experts)
        return new

    def _count(self, dropped, needed, balanced):
        OVERFLOW.budget_factor = self.budget_factor
        OVERFLOW.add(dropped, needed, balanced)

    # ------------------------------------------------------------------------------ dispatch
    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states)
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.num_tokens = hidden_states.shape[0]
        self.capacity = None
        self.probs_dtype = probs.dtype
        if self.comm == "allgather":
            self.indices, probs = _topk_indices(routing_map, probs, self.topk)
            return hidden_states, probs
        return self._send_buffers(hidden_states, routing_map, probs)

    def _send_buffers(self, x, routing_map, probs):
        """[ep * budget] rows: destination rank r's pairs (expert-major, tokens ascending, as
        upstream's permute) at rows r * budget + 0, 1, ...; the rest zeros."""
        T, E, L, ep = self.num_tokens, self.num_experts, self.num_local_experts, self.ep_size
        B, balanced = budget_rows(T, self.topk, E, L, self.budget_factor, self.rows_per_token)
        self.budget = B
        pairs = T * min(self.topk, E)  # an upper bound of the routed pairs: a host number
        permuted, permuted_probs, self.sorted_indices, _, _ = self.up.permute(
            x, routing_map, probs=probs, num_out_tokens=pairs
        )
        dev = x.device
        with torch.no_grad():
            counts = routing_map.sum(dim=0)  # [E]
            per_dest = counts.view(ep, L).sum(dim=1)
            j = torch.arange(pairs, device=dev)
            expert = torch.searchsorted(counts.cumsum(0), j, right=True)  # E for the unrouted tail
            dest = (expert // L).clamp_(max=ep - 1)
            pos = j - (per_dest.cumsum(0) - per_dest)[dest]
            keep = (expert < E) & (pos < B)
            self.slot = torch.where(keep, dest * B + pos, torch.full_like(pos, ep * B))
            end = counts.view(ep, L).cumsum(dim=1)
            self.kept = end.clamp(max=B) - (end - counts.view(ep, L)).clamp(max=B)  # [ep, L]
            self._count((per_dest - B).clamp(min=0).sum(), per_dest.max(), balanced)
            # tokens that lost a pair to the budget (inspection; zeros when nothing overflows)
            lost = (expert < E) & ~keep
            self.tokens_dropped = torch.zeros(T + 1, dtype=torch.bool, device=dev).index_fill_(
                0, torch.where(lost, self.sorted_indices, torch.full_like(self.sorted_indices, T)), True)[:T]
        H = x.shape[-1]
        send = permuted.new_zeros(ep * B + 1, H).index_copy(0, self.slot, permuted)[: ep * B]
        send_probs = permuted_probs.new_zeros(ep * B + 1).index_copy(0, self.slot, permuted_probs)[: ep * B]
        self.rows_sent = ep * B
        return send, send_probs

    def _token_dispatch(self, hidden_states, probs):
        if self.comm == "allgather":
            return super()._token_dispatch(hidden_states, probs)
        kept = self.kept.reshape(-1)
        if self.ep_size > 1:
            hidden_states = self.up.all_to_all(self.ep_group, hidden_states, None, None)
            probs = self.up.all_to_all(self.ep_group, probs, None, None)
            with torch.no_grad():
                kept = self.up.all_to_all(self.ep_group, kept, None, None)
        self.received = kept.view(self.ep_size, self.num_local_experts)  # [source ep, L]
        self.kept = None
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        if self.comm == "allgather":
            return self._allgather_postprocess(hidden_states, probs)
        L, tp, ep, B = self.num_local_experts, self.tp_size, self.ep_size, self.budget
        counts = self.received
        self.received = None
        if tp > 1:
            hidden_states = self.up.gather(hidden_states, group=self.tp_group)
            probs = self.up.gather(probs, group=self.tp_group)
            with torch.no_grad():
                counts = self.up.gather(counts.reshape(-1), group=self.tp_group)
        S = tp * ep  # sources, [tp][ep] order as upstream's chunks
        R = S * B
        with torch.no_grad():
            counts = counts.view(S, L)
            end = counts.cumsum(dim=1)  # [S, L]
            p = torch.arange(B, device=counts.device).expand(S, B).contiguous()
            expert = torch.searchsorted(end, p, right=True)  # [S, B]; L for padding rows
            e = expert.clamp(max=L - 1)
            per_expert = counts.sum(dim=0)
            first = (per_expert.cumsum(0) - per_expert)[e]  # where expert e's rows start
            before = (counts.cumsum(dim=0) - counts).gather(1, e)  # rows of e from earlier sources
            within = p - (end - counts).gather(1, e)
            dst = torch.where(expert < L, first + before + within, torch.full_like(p, R))
            self.dst = dst.reshape(-1)
        H = hidden_states.shape[-1]
        x = hidden_states.new_zeros(R + 1, H).index_copy(0, self.dst, hidden_states)[:R]
        probs = probs.new_zeros(R + 1).index_copy(0, self.dst, probs)[:R]
        return x, per_expert, probs

    # ------------------------------------------------------------------------------ combine
    def combine_preprocess(self, hidden_states):
        if self.comm == "allgather":
            out = self.up.unpermute(hidden_states, self.local_sorted_indices, restore_shape=self.local_shape)
            self.local_sorted_indices = None
            return out
        padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])
        out = padded.index_select(0, self.dst)
        self.dst = None
        if self.tp_size > 1:
            out = self.up.reduce_scatter(out.to(self.probs_dtype), group=self.tp_group).to(out.dtype)
        return out

    def _token_combine(self, hidden_states):
        if self.comm == "allgather":
            return super()._token_combine(hidden_states)
        if self.ep_size > 1:
            hidden_states = self.up.all_to_all(self.ep_group, hidden_states, None, None)
        return hidden_states

    def combine_postprocess(self, hidden_states):
        if self.comm == "alltoall":
            padded = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])
            pairs = padded.index_select(0, self.slot)
            hidden_states = self.up.unpermute(
                pairs, self.sorted_indices, restore_shape=(self.num_tokens, self.hidden_shape[-1])
            )
            self.slot = self.sorted_indices = None
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output += self.shared_experts.get_output()
        return output

    # ------------------------------------------------------------------------------ allgather
    def _allgather_postprocess(self, hidden_states, probs):
        """All gathered tokens [N]: the local experts' pairs, expert-major, in a buffer of
        ``budget`` rows (upstream's permute, with a host-known output size)."""
        L, lo = self.num_local_experts, self._lo
        indices = self.indices
        self.indices = None
        local = torch.where((indices >= lo) & (indices < lo + L), indices - lo, torch.full_like(indices, -1))
        local_map, local_probs = indices_to_multihot(local, probs, L)
        N = hidden_states.shape[0]
        B, balanced = budget_rows(N, self.topk, self.num_experts, L, self.budget_factor, self.rows_per_token)
        self.budget = B
        self.local_shape = hidden_states.shape
        with torch.no_grad():
            counts = local_map.sum(dim=0)
            end = counts.cumsum(0)
            kept = end.clamp(max=B) - (end - counts).clamp(max=B)
            total = end[-1]
            self._count((total - B).clamp(min=0), total, balanced)
        permuted, permuted_probs, self.local_sorted_indices, _, _ = self.up.permute(
            hidden_states, local_map, probs=local_probs, num_out_tokens=B
        )
        return permuted, kept, permuted_probs


def _topk_indices(routing_map, probs, topk):
    from megatron_ext.moe.dispatcher import routing_map_to_indices

    return routing_map_to_indices(routing_map, probs, topk, capacity=False)
