"""Structural overlap figure: for each recorded TP collective, the compute issued on the rank
between its start and its wait, against a stated link model, as the fraction of TP communication
that would be hidden on a GPU cluster. Machine noise does not enter: only bytes and FLOPs.

    t_comm(c)   = latency + factor(op, n) * bytes(c) / bus_bandwidth        (NCCL bus-bandwidth form:
                  all-reduce 2(n-1)/n of the buffer, all-gather / reduce-scatter (n-1)/n of the
                  full buffer, all-to-all (n-1)/n)
    t_hidden(c) = min(t_comm(c), flops_between(c) / effective_flops)
    hidden      = sum t_hidden / sum t_comm   over the TP collectives of the step

`scale` re-sizes the recorded step to another layer shape under the same structure: linear-layer
FLOPs scale with tokens x hidden^2, attention bmm FLOPs with tokens x seq x hidden, bytes with
tokens x hidden (an approximation; it keeps which compute lies between which collective).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    bus_bandwidth: float  # bytes/s
    latency: float        # s per collective
    flops: float          # effective FLOP/s of the GPU for the GEMMs between


# Stated figures (public datasheet numbers, derated): H100 SXM, NVLink 4 (450 GB/s per direction
# per GPU; NCCL all-reduce bus bandwidth ~360 GB/s measured by nccl-tests on 8 GPUs), InfiniBand
# NDR 400 Gb/s per GPU (50 GB/s; ~45 GB/s bus bandwidth); BF16 dense 989 TFLOP/s peak, 40% taken
# as the effective rate of the mid-sized GEMMs between collectives.
NVLINK = Link("NVLink4 (H100 SXM, intra-node TP)", 360e9, 10e-6, 0.4 * 989e12)
INFINIBAND = Link("InfiniBand NDR400 (TP across nodes)", 45e9, 20e-6, 0.4 * 989e12)
LINKS = (NVLINK, INFINIBAND)


def bus_factor(op: str, n: int) -> float:
    """Bytes on the bus per byte of the collective over ``n`` ranks: 2(n-1)/n for an all-reduce, (n-1)/n
    for an all-gather or reduce-scatter (the bus bandwidth nccl-tests reports)."""
    if op.startswith("all_reduce"):
        return 2.0 * (n - 1) / n
    return (n - 1) / n


def modeled_hidden(records, link: Link, tp: int = 2, scale=(1.0, 1.0, 1.0)) -> dict:
    """records: dicts with op, nbytes, flops_linear, flops_attn (between start and wait).
    scale: (linear, attention, bytes) multipliers."""
    s_lin, s_attn, s_bytes = scale
    total = hidden = 0.0
    for r in records:
        t = link.latency + bus_factor(r["op"], tp) * r["nbytes"] * s_bytes / link.bus_bandwidth
        compute = (r["flops_linear"] * s_lin + r["flops_attn"] * s_attn) / link.flops
        total += t
        hidden += min(t, compute)
    return {"link": link.name, "comm_s": total, "hidden_s": hidden,
            "hidden_fraction": hidden / total if total else 0.0}


def shape_scale(run: dict, target: dict) -> tuple:
    """Multipliers from the recorded shape to a target (hidden, seq, micro_batch_size)."""
    tokens = (target["seq"] * target["mbs"]) / (run["seq"] * run["mbs"])
    h = target["hidden"] / run["hidden"]
    s = target["seq"] / run["seq"]
    return (tokens * h * h, tokens * s * h, tokens * h)
