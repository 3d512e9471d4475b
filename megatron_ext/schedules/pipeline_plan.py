"""The 1F1B overlap's per-rank plan, pure functions of the layout (overlap_1f1b.py executes it):
``plan`` orders the events (forwards, paired forwards, overlapped forward-backward pairs, backwards),
``steps`` adds every pipeline message a rank receives and sends around each event, and ``program``
turns those into the NCCL-rules checker's input (p2p.py). No process group, no tensor: tested directly."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


def _warmup(pp: int, rank: int, chunks: int, group: int, total: int) -> int:
    return min(total, 2 * (pp - rank - 1) + (chunks - 1) * group + 1)


def plan(num_microbatches: int, chunks: int, pp: int, rank: int, group: Optional[int] = None,
         pair_warmup: bool = False):
    """The per-rank event list: ("F", v) / ("FF", v, v + 1) / ("B", v) / ("FB", v_f, v_b). Pure;
    tested directly."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    group = group if (group and chunks > 1) else num_microbatches
    table = get_schedule_table(num_microbatches, chunks, group)
    total = len(table)
    w = _warmup(pp, rank, chunks, group, total)
    pairs = w // 2 if pair_warmup else 0
    events = [("FF", 2 * i, 2 * i + 1) for i in range(pairs)] + [("F", v) for v in range(2 * pairs, w)]
    f, b = w, 0
    while b < total:
        if f < total:
            events.append(("FB", f, b))
            f += 1
        else:
            events.append(("B", b))
        b += 1
    return table, events


# ---- pipeline messages ------------------------------------------------------------------------
# A message is named by the pass that consumes it: ("act", mb, chunk) feeds the forward of
# micro-batch mb on the receiver's model chunk `chunk`, ("grad", mb, chunk) its backward.
# Communicators: one per kind and direction ("act_up": from a lower to a higher pipeline rank, ...),
# so that on each of them one rank only sends and the other only receives, both in the schedule
# table's order. With both directions on one communicator (PP=2 with virtual stages: activations
# flow 0->1 and, between chunks, 1->0) NCCL's in-order execution can put two sends head to head.
DIRECTIONAL = "directional"
SHARED = "shared"  # one communicator per kind, both directions on it (kept to show why not)
COMMS = ("act_up", "act_down", "grad_up", "grad_down")


def comm_name(kind: str, src: int, dst: int, layout: str = DIRECTIONAL) -> str:
    if layout == SHARED:
        return kind
    return f"{kind}_{'up' if src < dst else 'down'}"


@dataclass
class Step:
    """One event of the plan with its pipeline messages, in the order they are issued: receives
    posted, then waited for; our own sends of the outputs about to be back-propagated waited for
    (their receivers have consumed them: the gradient came back); the passes; then the sends."""

    event: tuple
    recv: List[tuple] = field(default_factory=list)        # (kind, mb, chunk, peer)
    await_sent: List[tuple] = field(default_factory=list)  # keys of earlier sends
    send: List[tuple] = field(default_factory=list)        # (kind, mb, receiver's chunk, peer, own chunk)


def _passes(ev) -> tuple:
    """(forwards, backwards) of an event, virtual micro-batch indices in the table's order."""
    kind = ev[0]
    if kind == "F":
        return [ev[1]], []
    if kind == "FF":
        return [ev[1], ev[2]], []
    if kind == "B":
        return [], [ev[1]]
    return [ev[1]], [ev[2]]


def steps(num_microbatches: int, chunks: int, pp: int, rank: int, group: Optional[int] = None,
          pair_warmup: bool = False):
    """plan() with every pipeline message this rank receives and sends. Pure: the schedule runs
    exactly these, and `program()` turns them into the checker's input."""
    table, events = plan(num_microbatches, chunks, pp, rank, group, pair_warmup)
    first, last = rank == 0, rank == pp - 1
    nxt, prv = (rank + 1) % pp, (rank - 1) % pp
    out = []
    sent_act = set()

    def fwd(v):
        return table[v]

    def bwd(v):
        mb, c = table[v]
        return mb, chunks - 1 - c

    for ev in events:
        step = Step(ev)
        forwards, backwards = _passes(ev)
        for vf in forwards:
            mb, c = fwd(vf)
            if pp > 1 and not (first and c == 0):
                step.recv.append(("act", mb, c, prv))
        for vb in backwards:
            mb, c = bwd(vb)
            if pp > 1 and not (last and c == chunks - 1):
                step.recv.append(("grad", mb, c, nxt))
            if (mb, c) in sent_act:
                step.await_sent.append(("act", mb, c))
        for vf in forwards:
            mb, c = fwd(vf)
            if pp > 1 and not (last and c == chunks - 1):
                step.send.append(("act", mb, c if not last else c + 1, nxt, c))
                sent_act.add((mb, c))
        for vb in backwards:
            mb, c = bwd(vb)
            if pp > 1 and not (first and c == 0):
                step.send.append(("grad", mb, c if not first else c - 1, prv, c))
        out.append(step)
    return table, out


def program(num_microbatches: int, chunks: int, pp: int, rank: int, group: Optional[int] = None,
            layout: str = DIRECTIONAL, ranks: Optional[list] = None, pair_warmup: bool = False) -> list:
    """This rank's pipeline messages as the p2p checker's program (p2p.Op / p2p.Wait).
    `ranks`: global rank of each pipeline rank (default: the pipeline ranks themselves)."""
    from megatron_ext.schedules.p2p import Op, Wait

    ranks = ranks or list(range(pp))
    me = ranks[rank]
    prog, sends, waited = [], {}, set()
    for step in steps(num_microbatches, chunks, pp, rank, group, pair_warmup)[1]:
        posted = []
        for kind, mb, c, peer in step.recv:
            posted.append(len(prog))
            prog.append(Op("recv", ranks[peer], comm_name(kind, ranks[peer], me, layout), (kind, mb, c)))
        prog += [Wait(i) for i in posted]
        for key in step.await_sent:
            prog.append(Wait(sends[key]))
            waited.add(key)
        for kind, mb, c, peer, own in step.send:
            sends[(kind, mb, own)] = len(prog)
            prog.append(Op("send", ranks[peer], comm_name(kind, me, ranks[peer], layout), (kind, mb, c)))
    return prog + [Wait(i) for key, i in sends.items() if key not in waited]
