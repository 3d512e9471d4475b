"""Measuring the TP-overlap schedule: a recorder for megatron_ext.schedules.lanes' hook and a FLOP
counter.

The recorder keeps, per TP/EP collective, who issued it (pass label, lane), when it was issued and
waited for, whether the baton was handed to the other micro-batch in between, and the matmul FLOPs
the rank issued between its start and its wait (with `FlopCounter` active). On CUDA the time the
compute waited for it comes from the CUDA events the runtime records around the wait.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


@dataclass
class CollectiveRecord:
    op: str                 # all_reduce / all_gather / reduce_scatter / all_to_all
    group: str              # "tp" or "ep"
    nbytes: int
    owner: str              # label of the micro-batch pass that issued it, e.g. "F3" / "B1"
    lane: str               # "F", "B" or "-" (outside a pair)
    t_issue: float
    t_wait0: float = 0.0    # host starts waiting
    t_wait1: float = 0.0    # wait returned
    t_done: float = 0.0     # completion seen by the communication library (callback), if known
    flops_between: int = 0  # matmul FLOPs issued on this rank between issue and wait
    attn_flops_between: int = 0  # the part of it in bmm/baddbmm (attention scores / context)
    handed_off: bool = False  # the other lane ran between issue and wait
    partner_done: bool = False  # issued in a pair whose other lane had already finished
    issued_async_by_upstream: bool = False  # megatron itself asked for async_op=True
    in_place: bool = False  # waited for without a hand-off (group_kinds.waits_in_place)
    events: Optional[tuple] = field(default=None, repr=False)  # CUDA events around the wait

    @property
    def exposed(self) -> float:
        """Time the compute waited for it: the compute stream's on CUDA, the host's on CPU."""
        if self.events is not None:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.t_wait1 - self.t_wait0


@dataclass
class Segment:
    owner: str
    lane: str
    t0: float
    t1: float


@dataclass
class Recorder:
    """Install with ``lanes.set_hook(recorder)``; FLOPs are counted while a ``FlopCounter(recorder)``
    is active (a dispatch mode: carried to the lane and autograd threads like any other)."""

    collectives: List[CollectiveRecord] = field(default_factory=list)
    segments: List[Segment] = field(default_factory=list)
    flops: int = 0
    attn_flops: int = 0

    # --- the hook the runtime calls ---
    def collective_issued(self, op, kind, nbytes, label, lane, upstream_async):
        rec = CollectiveRecord(op, kind, nbytes, label, lane, time.perf_counter(),
                               flops_between=self.flops, attn_flops_between=self.attn_flops,
                               issued_async_by_upstream=upstream_async)
        self.collectives.append(rec)
        return rec

    def collective_done(self, rec) -> None:
        rec.t_done = time.perf_counter()

    def collective_waited(self, rec, t0, t1, events, handed_off, partner_done) -> None:
        rec.t_wait0, rec.t_wait1, rec.events = t0, t1, events
        rec.handed_off, rec.partner_done = handed_off, partner_done
        rec.flops_between = self.flops - rec.flops_between
        rec.attn_flops_between = self.attn_flops - rec.attn_flops_between
        if not rec.t_done:
            rec.t_done = t1

    def segment(self, label, lane, t0, t1) -> None:
        self.segments.append(Segment(label, lane, t0, t1))

    # --- summaries ---
    def exposed(self, group: str = "tp") -> float:
        return sum(c.exposed for c in self.collectives if c.group == group)

    def b_lane(self, group: str = "tp") -> dict:
        """Collectives a paired backward issued: how many, how many handed to the forward, and
        how many could not be (the forward lane had finished)."""
        b = [c for c in self.collectives if c.group == group and c.lane == "B"]
        return {"collectives": len(b), "handed_off": sum(c.handed_off for c in b),
                "partner_done": sum(c.partner_done and not c.handed_off and not c.in_place for c in b),
                "in_place": sum(c.in_place for c in b)}


_ATTENTION = {torch.ops.aten.bmm, torch.ops.aten.baddbmm}


class FlopCounter(TorchDispatchMode):
    """FLOPs of every op torch's FLOP formulas know (torch.utils.flop_counter: mm, addmm, bmm,
    baddbmm, convolutions, attention kernels), added to the recorder as the ops run, on whatever
    thread (lanes, the autograd device thread). torch's FlopCounterMode sums per module instead,
    with module hooks that do not follow two interleaved passes."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.recorder.flops += flops
            if func._overloadpacket in _ATTENTION:
                self.recorder.attn_flops += flops
        return out


# ------------------------------------------------------------------------------------------------
# megatron's combined-1F1B plan (--overlap-moe-expert-parallel-comm), structurally
# ------------------------------------------------------------------------------------------------
COMM_NODES = ("moe_dispatch", "moe_combine")


@dataclass
class NodeCall:
    name: str       # the plan's node name (pre_dispatch_computation, moe_dispatch, mlp, moe_combine, ...)
    direction: str  # "F" or "B"
    owner: int      # the micro-batch's plan (id of its chunk state)
    flops_linear: int = 0
    flops_attn: int = 0
    collectives: list = field(default_factory=list)  # CollectiveRecords issued inside it


class NodeLog:
    """The nodes megatron's plan ran, in issue order, with the FLOPs and collectives of each
    (megatron_ext.seams.schedules.plan_nodes_recorded; FLOPs from a FlopCounter on `recorder`)."""

    def __init__(self, recorder: Recorder):
        self.rec, self.calls = recorder, []

    def __call__(self, node, direction, run):
        call = NodeCall(getattr(node, "name", "?"), direction, id(getattr(node, "chunk_state", node)))
        f0, a0, c0 = self.rec.flops, self.rec.attn_flops, len(self.rec.collectives)
        try:
            return run()
        finally:
            call.flops_attn = self.rec.attn_flops - a0
            call.flops_linear = self.rec.flops - f0 - call.flops_attn
            call.collectives = self.rec.collectives[c0:]
            self.calls.append(call)

    def ep_records(self) -> list:
        """Each EP collective with the compute the plan runs beside it on a GPU: megatron issues a
        dispatch/combine node on its communication stream and the next nodes on the compute stream;
        those of the *other* micro-batch (independent of it) until the next communication node
        overlap it (schedule_layer_1f1b, model_chunk_schedule_plan.py:224-289). Nodes of the same
        micro-batch wait for it. Unpaired passes (warmup / cooldown) have no other micro-batch."""
        out = []
        for i, call in enumerate(self.calls):
            if call.name not in COMM_NODES:
                continue
            lin = attn = 0
            for nxt in self.calls[i + 1:]:
                if nxt.name in COMM_NODES:
                    break
                if nxt.owner != call.owner:
                    lin += nxt.flops_linear
                    attn += nxt.flops_attn
            ep = [c for c in call.collectives if c.group == "ep"]
            if ep:  # a node's collectives (tokens, probs, counts) run back to back on the comm stream
                out.append({"op": "all_to_all", "nbytes": sum(c.nbytes for c in ep),
                            "flops_linear": lin, "flops_attn": attn, "count": len(ep)})
        return out
