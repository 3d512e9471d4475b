"""Job functions for tests/attention/test_context_parallel.py (every rank of a persistent gloo world)."""
from __future__ import annotations

import torch
import torch.distributed as dist

# (name, heads, groups, dk, dv, causal, window, sink, documents, comm types)
KERNEL_CASES = [
    ("causal", 4, 4, 16, 16, True, None, False, False, ("p2p", "all_gather", "a2a")),
    ("gqa", 8, 2, 16, 16, True, None, False, False, ("p2p", "all_gather", "a2a")),
    ("latent", 4, 4, 24, 16, True, None, False, False, ("p2p", "all_gather", "a2a")),
    ("window_sinks", 4, 2, 16, 16, True, (5, 0), True, False, ("all_gather", "a2a")),
    ("documents", 4, 2, 16, 16, True, None, False, True, ("all_gather", "a2a")),
    ("documents_window_sinks", 4, 4, 16, 16, True, (3, 0), True, True, ("all_gather", "a2a")),
]
SEQ, BATCH = 32, 2


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def kernels_match_one_rank() -> dict:
    """Every case and comm type over the whole world as one CP group against kernels.attend on the
    full sequence (fp32): ‖Δ‖/‖ref‖ of the output and of dq, dk, dv (and the sinks' gradient), each
    rank's share compared with the same rows of the reference."""
    from megatron_ext.attention import context_parallel as cpa
    from megatron_ext.attention import kernels
    from megatron_ext.platform import init_distributed
    from megatron_ext.sft.attention import block_causal_mask

    init_distributed()
    group = dist.new_group(backend="gloo")
    try:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = cpa.positions(SEQ // cp, cp, rank, "cpu")
        out = {}
        for name, h, g, dk, dv, causal, window, with_sink, documents, comm_types in KERNEL_CASES:
            gen = torch.Generator().manual_seed(5)
            q = torch.randn(BATCH, h, SEQ, dk, generator=gen)
            k = torch.randn(BATCH, g, SEQ, dk, generator=gen)
            v = torch.randn(BATCH, g, SEQ, dv, generator=gen)
            dout = torch.randn(BATCH, h, SEQ, dv, generator=gen)
            sink = torch.randn(h, generator=gen) if with_sink else None
            mask = None
            if documents:
                segments = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * 20 + [1] * 12])
                mask = block_causal_mask(segments)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)] + (
                [sink.clone().requires_grad_()] if with_sink else [])
            ref = kernels.attend(*ref_in[:3], scale=0.25, causal=causal, mask=mask, window=window,
                                 sink=ref_in[3] if with_sink else None)
            ref.backward(dout)
            for comm in comm_types:
                ins = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
                s = sink.clone().requires_grad_() if with_sink else None
                local_mask = None if mask is None else mask[:, :, mine].clone()
                got = cpa.attend(comm, *ins, group=group, scale=0.25, causal=causal, mask=local_mask,
                                 window=window, sink=s)
                got.backward(dout[:, :, mine])
                errors = [_rel(got, ref[:, :, mine])] + [
                    _rel(t.grad, r.grad[:, :, mine]) for t, r in zip(ins, ref_in[:3])]
                if with_sink:
                    total = s.grad.clone()
                    dist.all_reduce(total, group=group)  # each rank's share of the sinks' gradient
                    errors.append(_rel(total, ref_in[3].grad))
                out[f"{name}/{comm}"] = errors
        return out
    finally:
        dist.destroy_process_group(group)


def one_rank_simulation_matches() -> dict:
    """Every rank given the same local queries, keys and values (so what it receives equals its own):
    each comm type over the real group against ``OneRank(cp, rank)`` on this rank alone, the output and
    dq (what depends only on what arrives; for a2a this rank's heads, the others' come from the other
    ranks' kernels): ‖Δ‖/‖ref‖ per case."""
    from megatron_ext.attention import context_parallel as cpa
    from megatron_ext.platform import init_distributed

    init_distributed()
    group = dist.new_group(backend="gloo")
    try:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        out = {}
        for name, h, g, dk, dv, causal, window, with_sink, _, comm_types in KERNEL_CASES:
            gen = torch.Generator().manual_seed(7)  # the same on every rank
            q, k = torch.randn(BATCH, h, SEQ // cp, dk, generator=gen), torch.randn(BATCH, g, SEQ // cp, dk, generator=gen)
            v, dout = torch.randn(BATCH, g, SEQ // cp, dv, generator=gen), torch.randn(BATCH, h, SEQ // cp, dv, generator=gen)
            sink = torch.randn(h, generator=gen) if with_sink else None
            for comm in comm_types:
                runs = []
                for where in (group, cpa.OneRank(cp, rank)):
                    qq = q.clone().requires_grad_()
                    got = cpa.attend(comm, qq, k, v, group=where, scale=0.25, causal=causal, window=window, sink=sink)
                    got.backward(dout)
                    runs.append((got.detach(), qq.grad))
                if comm == "a2a":  # this rank's heads
                    mine = slice(rank * h // cp, (rank + 1) * h // cp)
                    runs = [(o[:, mine], d[:, mine]) for o, d in runs]
                (real, real_dq), (alone, alone_dq) = runs
                out[f"{name}/{comm}"] = [_rel(alone, real), _rel(alone_dq, real_dq)]
        return out
    finally:
        dist.destroy_process_group(group)
