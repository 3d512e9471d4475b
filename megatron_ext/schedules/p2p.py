"""Point-to-point programs and a checker that decides, under NCCL's rules, whether they complete.

A program is one rank's sequence of items, in the order the host issues them:

    Op(kind, peer, comm, label, group)   kind "send" / "recv" to/from global rank `peer`, issued
                                         non-blocking on process group `comm`
    Wait(op)                             the rank waits for its op number `op` (index into the program)

NCCL's rules, as modelled (docs/overlap.md, "Pipeline messages under NCCL"):

* single ops between two ranks of a group run on one communicator per (group, rank pair), shared
  by both directions; ops of one `batch_isend_irecv` (consecutive Ops with the same `group`
  number) run as one unit on the group's collective communicator instead;
* a communicator runs its ops (units) one after another in issue order;
* the n-th send from a to b on a communicator is received by b's n-th recv from a on it, and the
  two complete together, only when both are running (no buffering: the strict rule, what large
  messages see);
* a wait holds back everything the rank issues after it (on a GPU the compute stream waits, and
  every later op waits for the compute stream when it is issued).

`check(programs)` runs the ranks' programs against those rules to a fixed point. A program that
does not complete under them hangs on NCCL; two matched ops whose labels differ deliver the wrong
tensor (NCCL ignores tags).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union


@dataclass(frozen=True)
class Op:
    kind: str                   # "send" | "recv"
    peer: int                   # global rank
    comm: Any                   # the process group (any hashable name, equal on both ranks)
    label: Any = None           # what the message carries; both sides name it alike
    group: Optional[int] = None  # batch_isend_irecv number: consecutive ops with it form one unit


@dataclass(frozen=True)
class Wait:
    op: int  # index, in the same program, of the op waited for


Item = Union[Op, Wait]


@dataclass
class Verdict:
    completes: bool
    pending: Dict[int, List[str]] = field(default_factory=dict)  # rank -> what it still waits on
    mismatched: List[str] = field(default_factory=list)  # matched ops carrying different labels
    unmatched: List[str] = field(default_factory=list)   # ops with no partner at all

    @property
    def ok(self) -> bool:
        return self.completes and not self.mismatched

    def report(self) -> str:
        lines = []
        for rank, items in sorted(self.pending.items()):
            lines.append(f"rank {rank}: " + "; ".join(items))
        lines += [f"mismatch: {m}" for m in self.mismatched]
        lines += [f"unmatched: {m}" for m in self.unmatched]
        return "\n".join(lines)


def describe(rank: int, op: Op) -> str:
    arrow = f"send to {op.peer}" if op.kind == "send" else f"recv from {op.peer}"
    label = f" {op.label}" if op.label is not None else ""
    grouped = f" [grouped {op.group}]" if op.group is not None else ""
    return f"{arrow} on {op.comm}{label}{grouped}"


def _queue_key(rank: int, op: Op):
    if op.group is not None:
        return ("group", op.comm)
    return ("pair", op.comm, min(rank, op.peer), max(rank, op.peer))


def check(programs: Dict[int, List[Item]]) -> Verdict:
    """Whether every rank's program completes under NCCL's p2p rules (see the module doc)."""
    # 1. static matching: the n-th send a->b on a communicator pairs with b's n-th recv from a
    partner: Dict[tuple, tuple] = {}
    sends: Dict[tuple, List[tuple]] = defaultdict(list)
    recvs: Dict[tuple, List[tuple]] = defaultdict(list)
    for rank, prog in programs.items():
        for i, item in enumerate(prog):
            if isinstance(item, Op):
                scope = _queue_key(rank, item)[:2]
                if item.kind == "send":
                    sends[(scope, rank, item.peer)].append((rank, i))
                elif item.kind == "recv":
                    recvs[(scope, item.peer, rank)].append((rank, i))
                else:
                    raise ValueError(f"rank {rank} item {i}: unknown op kind {item.kind!r}")
            elif not (isinstance(item, Wait) and 0 <= item.op < i and isinstance(prog[item.op], Op)):
                raise ValueError(f"rank {rank} item {i}: {item!r} must wait for an earlier op")
    mismatched, unmatched = [], []
    for key in set(sends) | set(recvs):
        s, r = sends.get(key, []), recvs.get(key, [])
        for a, b in zip(s, r):
            partner[a], partner[b] = b, a
            la, lb = programs[a[0]][a[1]].label, programs[b[0]][b[1]].label
            if la is not None and lb is not None and la != lb:
                mismatched.append(f"rank {a[0]} {describe(a[0], programs[a[0]][a[1]])} is received by "
                                  f"rank {b[0]} as {lb}")
        for x in s[len(r):] + r[len(s):]:
            unmatched.append(f"rank {x[0]}: {describe(x[0], programs[x[0]][x[1]])}")

    # 2. run to a fixed point
    done = set()
    pc = {rank: 0 for rank in programs}
    queues: Dict[int, Dict[tuple, deque]] = {rank: defaultdict(deque) for rank in programs}
    running = set()
    work = deque()  # ops that just started running

    def start_head(rank, key):
        q = queues[rank][key]
        while q and all((rank, i) in done for i in q[0]):
            q.popleft()
        if q:
            for i in q[0]:
                if (rank, i) not in running:
                    running.add((rank, i))
                    work.append((rank, i))

    def advance(rank):
        prog = programs[rank]
        while pc[rank] < len(prog):
            item = prog[pc[rank]]
            if isinstance(item, Wait):
                if (rank, item.op) not in done:
                    return
                pc[rank] += 1
                continue
            unit = [pc[rank]]
            pc[rank] += 1
            if item.group is not None:
                while (pc[rank] < len(prog) and isinstance(prog[pc[rank]], Op)
                       and prog[pc[rank]].group == item.group):
                    unit.append(pc[rank])
                    pc[rank] += 1
            key = _queue_key(rank, item)
            queues[rank][key].append(unit)
            if len(queues[rank][key]) == 1:
                start_head(rank, key)

    for rank in programs:
        advance(rank)
    while work:
        a = work.popleft()
        b = partner.get(a)
        if b is None or b not in running or a in done:
            continue
        for rank, i in (a, b):
            done.add((rank, i))
            running.discard((rank, i))
        for rank, i in (a, b):
            start_head(rank, _queue_key(rank, programs[rank][i]))
            advance(rank)

    pending = {}
    for rank, prog in programs.items():
        waiting = []
        if pc[rank] < len(prog):
            item = prog[pc[rank]]
            waiting.append(f"host blocked at item {pc[rank]} (wait for op {item.op})")
        for key, q in queues[rank].items():
            for unit in q:
                for i in unit:
                    if (rank, i) not in done:
                        state = "running" if (rank, i) in running else "queued"
                        waiting.append(f"{state} op {i}: {describe(rank, prog[i])}")
        if waiting:
            pending[rank] = waiting
    completes = not pending and not unmatched
    return Verdict(completes, pending, mismatched, unmatched)


def from_trace(trace: list) -> List[Item]:
    """A program recorded by the CUDA-faithful CPU mode (megatron_ext/platform/nccl_p2p.py TRACE):
    comm = the group's name, label = the user's tag where it is not 0 (ours name the message;
    NCCL ignores tags, and so does the matching here)."""
    prog, index = [], {}
    for item in trace:
        if item[0] == "op":
            _, op_id, kind, peer, group_name, tag = item
            index[op_id] = len(prog)
            prog.append(Op(kind, peer, group_name, tag or None))
        else:
            prog.append(Wait(index[item[1]]))
    return prog
