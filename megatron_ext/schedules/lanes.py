"""Two cooperative lanes that interleave one micro-batch's forward with another's backward.

The forward of micro-batch j runs in the calling thread (lane "F"), the backward of micro-batch i
in a helper thread (lane "B"). Exactly one lane runs at any time: they hand a baton back and forth
at every TP collective. A lane that reaches a collective issues it asynchronously, hands the
baton to the other lane, and waits on the collective's work handle only when it gets the baton
back, i.e. after the other lane has issued its own next collective. The compute of the other
micro-batch therefore sits between every collective's start and its wait.

Determinism: each lane's program (the per-micro-batch ops and the order of its collectives) is the
plain schedule's; the hand-off points are the collectives themselves, so the global order of
collectives is a pure function of the two programs and is identical on every rank of a TP group
(they run the same layers). No op is added, removed or reordered inside a micro-batch, so loss and
gradients are bit-identical to the plain schedule as long as the backwards stay in the plain order
(the schedule's job) and per-process state the two lanes share is kept per lane:

* RNG (CPU default generator, CUDA generator, model-parallel tracker) is saved/restored at every
  hand-off, so dropout in the forward draws exactly what it draws in the plain schedule;
* megatron's global "mpu" scratch buffer (sequence-parallel all-gathers) is per lane
  (megatron_ext/seams/schedules.py).

On CUDA the collectives run on the communication library's own stream (async_op=True) and the
lanes only decide the host-side launch order; on CPU+gloo the same code uses gloo's async work.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

_tls = threading.local()


# ---------------------------------------------------------------------------------------------
# which process groups count as tensor-parallel (overlapped) and which are only recorded
# ---------------------------------------------------------------------------------------------
class _Groups:
    tp: tuple = ()  # groups whose collectives are overlapped (TP, expert-TP)
    ep: tuple = ()  # expert-parallel groups (all-to-all), overlapped too; reported apart


GROUPS = _Groups()


def set_groups() -> None:
    """Read the current layout's TP / expert groups from megatron's parallel_state. A group is
    "tp" if its ranks are a tensor-parallel group's (expert-TP, or expert groups with EP=1), and
    "ep" if it spans expert-parallel ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def get(name):
        getter = getattr(ps, name, None)
        if getter is None:
            return None
        try:
            g = getter(check_initialized=False)
        except TypeError:
            g = getter()
        return g if g is not None and g.size() > 1 else None

    tp_group = get("get_tensor_model_parallel_group")
    tp_ranks = sorted(dist.get_process_group_ranks(tp_group)) if tp_group is not None else None
    tp, ep = [], []
    for name in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group",
                 "get_expert_model_parallel_group", "get_expert_tensor_and_model_parallel_group"):
        g = get(name)
        if g is None or any(g is x for x in tp + ep):
            continue
        same_as_tp = tp_ranks is not None and sorted(dist.get_process_group_ranks(g)) == tp_ranks
        is_tp = same_as_tp or name in ("get_tensor_model_parallel_group",
                                       "get_expert_tensor_parallel_group")
        (tp if is_tp else ep).append(g)
    GROUPS.tp, GROUPS.ep = tuple(tp), tuple(ep)


def group_kind(group) -> Optional[str]:
    if group is None:
        return None
    if any(group is g for g in GROUPS.tp):
        return "tp"
    if any(group is g for g in GROUPS.ep):
        return "ep"
    return None


# ---------------------------------------------------------------------------------------------
# recording (benchmarks, tests): every intercepted collective and every compute segment
# ---------------------------------------------------------------------------------------------
@dataclass
class CollectiveRecord:
    op: str                 # all_reduce / all_gather / reduce_scatter / all_to_all
    group: str              # "tp" or "ep"
    nbytes: int
    owner: str              # label of the micro-batch pass that issued it, e.g. "F3" / "B1"
    lane: str               # "F", "B" or "-" (plain schedule)
    t_issue: float
    t_wait0: float = 0.0    # host starts waiting
    t_wait1: float = 0.0    # wait returned
    t_done: float = 0.0     # completion seen by the communication library (callback), if known
    flops_between: int = 0  # matmul FLOPs issued on this rank between issue and wait
    attn_flops_between: int = 0  # the part of it in bmm/baddbmm (attention scores / context)
    handed_off: bool = False  # the other lane ran between issue and wait
    issued_async_by_upstream: bool = False  # megatron itself asked for async_op=True

    @property
    def exposed(self) -> float:
        return self.t_wait1 - self.t_wait0


@dataclass
class Segment:
    owner: str
    lane: str
    t0: float
    t1: float


@dataclass
class Recorder:
    collectives: List[CollectiveRecord] = field(default_factory=list)
    segments: List[Segment] = field(default_factory=list)
    count_flops: bool = False
    flops: int = 0
    attn_flops: int = 0

    def exposed(self, group: str = "tp") -> float:
        return sum(c.exposed for c in self.collectives if c.group == group)


RECORDER: Optional[Recorder] = None


def set_recorder(rec: Optional[Recorder]) -> None:
    global RECORDER
    RECORDER = rec


def owner_label() -> str:
    return getattr(_tls, "owner", "-")


class owner:
    """Label the work done inside (plain schedule: one forward/backward step)."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        self.prev = getattr(_tls, "owner", "-")
        _tls.owner = self.label
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if RECORDER is not None and current_lane() is None:
            RECORDER.segments.append(Segment(self.label, "-", self.t0, time.perf_counter()))
        _tls.owner = self.prev
        return False


# ---------------------------------------------------------------------------------------------
# FLOP counting (structural measure): matmul-family aten ops, counted on the lane that runs them
# ---------------------------------------------------------------------------------------------
def _mm_flops(func, args) -> int:
    aten = torch.ops.aten
    try:
        if func in (aten.mm.default,):
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if func in (aten.addmm.default,):
            a, b = args[1], args[2]
            return 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if func in (aten.bmm.default,):
            a, b = args[0], args[1]
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        if func in (aten.baddbmm.default,):
            a, b = args[1], args[2]
            return 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    except (AttributeError, IndexError):
        return 0
    return 0


class FlopCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rec = RECORDER
        if rec is not None and rec.count_flops:
            f = _mm_flops(func, args)
            rec.flops += f
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                rec.attn_flops += f
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# the two lanes
# ---------------------------------------------------------------------------------------------
def current_lane() -> Optional["Lane"]:
    return getattr(_tls, "lane", None)


def _rng_snapshot():
    from megatron.core import tensor_parallel

    state = [torch.get_rng_state(), None, None, None]
    if torch.cuda.is_available():
        state[1] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "states_", None) is not None:
        state[2] = tracker.get_states()
        state[3] = getattr(tracker, "_current_state_name", None)
    return state


def _rng_restore(state) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    if state[2] is not None:
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states(dict(state[2]))
        if state[3] is not None:
            tracker._current_state_name = state[3]


class Lane:
    def __init__(self, name: str, pair: "Pair", label: str):
        self.name, self.pair, self.label = name, pair, label
        self.done = False
        self.rng = None
        self.exc: Optional[BaseException] = None
        self.t_resumed = 0.0

    @property
    def other(self) -> "Lane":
        return self.pair.b if self is self.pair.f else self.pair.f

    # The running lane gives the baton to the other one and blocks until it comes back.
    def hand_off(self) -> bool:
        other = self.other
        if other.done:
            return False
        self._close_segment()
        self.rng = _rng_snapshot()
        cv = self.pair.cv
        with cv:
            self.pair.turn = other
            self.pair.switches += 1
            cv.notify_all()
            cv.wait_for(lambda: self.pair.turn is self)
        _rng_restore(self.rng)
        self.t_resumed = time.perf_counter()
        return True

    def _close_segment(self) -> None:
        if RECORDER is not None:
            RECORDER.segments.append(Segment(self.label, self.name, self.t_resumed, time.perf_counter()))

    def finish(self) -> None:
        self._close_segment()
        self.rng = _rng_snapshot()
        cv = self.pair.cv
        with cv:
            self.done = True
            if not self.other.done:
                self.pair.turn = self.other
            cv.notify_all()


_BUFFERS: dict = {}


def lane_memory_buffer():
    """Per-lane megatron GlobalMemoryBuffer (None outside a lane)."""
    lane = current_lane()
    if lane is None:
        return None
    buf = _BUFFERS.get(lane.name)
    if buf is None:
        from megatron.core.utils import GlobalMemoryBuffer

        buf = _BUFFERS[lane.name] = GlobalMemoryBuffer()
    return buf


def reset_buffers() -> None:
    _BUFFERS.clear()


def _inherit_thread_state(parent: dict) -> None:
    for mode in parent["function_modes"]:
        torch._C._push_on_torch_function_stack(mode)
    for mode in parent["dispatch_modes"]:
        torch._C._push_on_torch_dispatch_stack(mode)
    torch.set_grad_enabled(parent["grad"])


def _capture_thread_state() -> dict:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {
        "function_modes": list(_get_current_function_mode_stack()),
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "grad": torch.is_grad_enabled(),
    }


class Pair:
    """Run ``fwd()`` (calling thread) and ``bwd()`` (helper thread) interleaved at collectives."""

    def __init__(self, fwd_label: str, bwd_label: str):
        self.cv = threading.Condition()
        self.f = Lane("F", self, fwd_label)
        self.b = Lane("B", self, bwd_label)
        self.turn: Optional[Lane] = None
        self.switches = 0

    # Diagnostics only: run the pair's forward then its backward in the calling thread, no hand-off
    # (same schedule order, no interleaving).
    SERIAL = False

    def run(self, fwd: Callable, bwd: Callable):
        if Pair.SERIAL:
            return fwd(), bwd()
        start_rng = _rng_snapshot()
        parent = _capture_thread_state()
        results = {}

        def b_main():
            _inherit_thread_state(parent)
            _tls.lane = self.b
            _tls.owner = self.b.label
            with self.cv:
                self.cv.wait_for(lambda: self.turn is self.b)
            _rng_restore(start_rng)
            self.b.t_resumed = time.perf_counter()
            try:
                results["b"] = bwd()
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                self.b.exc = e
            finally:
                self.b.finish()

        thread = threading.Thread(target=b_main, name=f"overlap-bwd-{self.b.label}", daemon=True)
        thread.start()
        prev_lane, prev_owner = current_lane(), owner_label()
        _tls.lane, _tls.owner = self.f, self.f.label
        with self.cv:
            self.turn = self.f
        self.f.t_resumed = time.perf_counter()
        try:
            results["f"] = fwd()
        except BaseException as e:  # noqa: BLE001
            self.f.exc = e
        finally:
            self.f.finish()
            _tls.lane, _tls.owner = prev_lane, prev_owner
        with self.cv:
            self.cv.wait_for(lambda: self.b.done)
        thread.join()
        # Leave the process as the plain schedule would: the forward's RNG stream continues.
        _rng_restore(self.f.rng)
        for lane in (self.f, self.b):
            if lane.exc is not None:
                raise lane.exc
        return results.get("f"), results.get("b")


# ---------------------------------------------------------------------------------------------
# the collective wrapper used by the seams
# ---------------------------------------------------------------------------------------------
def active() -> bool:
    return RECORDER is not None or current_lane() is not None


class _Handle:
    """Stands in for a work handle megatron itself issued async (e.g. the dgrad all-reduce that
    megatron overlaps with the wgrad GEMM): its wait() first hands the baton over."""

    def __init__(self, work, rec: Optional[CollectiveRecord], lane: Optional[Lane], kind: str):
        self._work, self._rec, self._lane, self._kind = work, rec, lane, kind
        self._waited = False

    def wait(self, *args, **kwargs):
        if not self._waited:
            self._waited = True
            _finish(self._work, self._rec, self._lane, self._kind)
        return True

    def is_completed(self):
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _flops_now() -> int:
    return RECORDER.flops if RECORDER is not None else 0


EXPOSED_S: dict = {}  # host time blocked in waits, per group kind ("tp"/"ep"), for the log line


def _finish(work, rec: Optional[CollectiveRecord], lane: Optional[Lane], kind: str) -> None:
    handed = lane.hand_off() if lane is not None else False
    t0 = time.perf_counter()
    work.wait()
    t1 = time.perf_counter()
    EXPOSED_S[kind] = EXPOSED_S.get(kind, 0.0) + (t1 - t0)
    if rec is not None:
        rec.t_wait0, rec.t_wait1 = t0, t1
        rec.handed_off = handed
        rec.flops_between = _flops_now() - rec.flops_between
        rec.attn_flops_between = RECORDER.attn_flops - rec.attn_flops_between if RECORDER else 0
        if not rec.t_done:
            rec.t_done = t1


def collective(op: str, group, nbytes: int, start: Callable[[], object], async_op: bool):
    """Issue ``start()`` (which must launch the collective with async_op=True). For a caller that
    asked for a blocking collective, hand the baton over and wait here; for one that asked for an
    async handle, return a handle that does the same in wait()."""
    kind = group_kind(group)
    lane = current_lane()
    if kind is None or (lane is None and RECORDER is None):
        return None  # caller falls back to the original call
    rec = None
    if RECORDER is not None:
        rec = CollectiveRecord(
            op, kind, nbytes, owner_label(), lane.name if lane else "-", time.perf_counter(),
            flops_between=_flops_now(), attn_flops_between=RECORDER.attn_flops,
            issued_async_by_upstream=async_op,
        )
        RECORDER.collectives.append(rec)
    work = start()
    if rec is not None:
        try:
            work.get_future().add_done_callback(lambda _f, r=rec: setattr(r, "t_done", time.perf_counter()))
        except Exception:  # noqa: BLE001 - backends without futures: completion = wait end
            pass
    if async_op:
        return _Handle(work, rec, lane, kind)
    _finish(work, rec, lane, kind)
    return SYNC_DONE


SYNC_DONE = object()


def record_sync(op: str, group, run: Callable[[], object]):
    """A collective megatron runs blocking and we leave blocking (uneven list forms): timed only."""
    kind = group_kind(group)
    if RECORDER is None or kind is None:
        return run()
    lane = current_lane()
    t0 = time.perf_counter()
    rec = CollectiveRecord(op, kind, 0, owner_label(), lane.name if lane else "-", t0,
                           flops_between=0)
    out = run()
    rec.t_wait0, rec.t_wait1 = t0, time.perf_counter()
    rec.t_done = rec.t_wait1
    RECORDER.collectives.append(rec)
    return out
