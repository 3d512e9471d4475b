"""Two cooperative lanes that interleave one micro-batch's forward with another's backward.

The forward of micro-batch j runs in the calling thread (lane "F"), the backward of micro-batch i
in a helper thread (lane "B"). Exactly one lane runs at any time: they hand a baton back and forth
at every TP collective. A lane that reaches a collective issues it asynchronously, hands the
baton to the other lane, and waits on the collective's work handle only when it gets the baton
back, i.e. after the other lane has issued its own next collective. The compute of the other
micro-batch therefore sits between every collective's start and its wait. With expert parallelism
the backward starts the pair, otherwise the forward (Pair.backward_first).

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

Which lane is running is read from the pair's baton, never from the thread: on CUDA the autograd
engine runs a backward's nodes (and every collective they issue, and megatron's recompute) on its
device thread, not on the thread that called backward(), and it does not carry Python thread-locals
there. Whatever thread issues a collective is the one that blocks at the hand-off (the B lane's
helper thread waits inside backward() meanwhile). The CUDA-faithful CPU mode runs every backward on
such a thread too (megatron_ext/platform/autograd_thread.py), so the tests see this.

On CUDA the collectives run on the communication library's own stream (async_op=True) and the
lanes only decide the host-side launch order; on CPU+gloo the same code uses gloo's async work.
Time left waiting for them is taken on the compute stream with CUDA events there (host time on CPU).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

import torch

# ---------------------------------------------------------------------------------------------
# which process groups count as tensor-parallel (overlapped) and which are only recorded
# ---------------------------------------------------------------------------------------------
class _Groups:
    tp: tuple = ()  # groups whose collectives are overlapped (TP, expert-TP)
    ep: tuple = ()  # expert-parallel groups (all-to-all), overlapped too; reported apart
    hidden: int = 0  # the model's hidden size (set by the schedule): tells token rows from metadata


def is_metadata(kind: Optional[str], width: Optional[int]) -> bool:
    """An EP collective whose rows are at most a quarter of the hidden size wide (routing maps,
    probabilities, per-expert counts) is waited for in place, without handing the baton over: the
    token all-to-alls of a dispatch or combine then alternate with the other micro-batch's compute
    instead of the small collectives between them taking their turns. The row width is the same on
    every rank of the group (only row counts differ), so every rank makes the same choice and the
    collectives stay in the same order everywhere."""
    return kind == "ep" and width is not None and GROUPS.hidden > 0 and 4 * width <= GROUPS.hidden


GROUPS = _Groups()


def waits_in_place(kind: Optional[str], width: Optional[int], lane: Optional["Lane"]) -> bool:
    """Collectives waited for where they are issued, without handing the baton over:

    * EP metadata (is_metadata);
    * a TP collective while the other lane has a token all-to-all in flight ("EP first"): handing
      the baton back there would make the other lane wait for its all-to-all after only the compute
      up to this lane's next TP collective. Kept, the all-to-all has all of this lane's compute up
      to its own next token all-to-all behind it. On a cluster the all-to-all crosses nodes and
      costs several times the TP collectives inside a node; both kinds' figures are reported.

    Every rank of a group runs the same two programs under the same rules, so the baton moves at
    the same collectives everywhere and their order stays the same on every rank."""
    if is_metadata(kind, width):
        return True
    return kind == "tp" and lane is not None and lane.other.ep_in_flight > 0


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
    ep_group = get("get_expert_model_parallel_group")
    ep_size = ep_group.size() if ep_group is not None else 1
    tp, ep = [], []
    for name in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group",
                 "get_expert_model_parallel_group", "get_expert_tensor_and_model_parallel_group"):
        g = get(name)
        if g is None or any(g is x for x in tp + ep):
            continue
        # the expert groups carry the token dispatch: "ep" whenever expert parallelism is on, even
        # where its ranks are the TP group's (TP2 x EP2 on 2 processes, expert-TP 1)
        same_as_tp = tp_ranks is not None and sorted(dist.get_process_group_ranks(g)) == tp_ranks
        is_tp = name in ("get_tensor_model_parallel_group", "get_expert_tensor_parallel_group") or (
            same_as_tp and name == "get_expert_tensor_and_model_parallel_group" and ep_size < 2)
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
# recording hook (benchmarks, tests: scripts/bench/overlap.py); the runtime only calls it
# ---------------------------------------------------------------------------------------------
HOOK = None  # an object with collective_issued / collective_done / collective_waited / segment


def set_hook(hook) -> None:
    global HOOK
    _route_collectives_here()
    HOOK = hook


def _route_collectives_here() -> None:
    """The seams that wrap megatron-core's collectives route them to this module from now on
    (megatron_ext/seams/schedules.py bind_lanes): before a pair runs or a recorder is set, the only
    ways these lanes become active."""
    from megatron_ext.seams import schedules as seams

    seams.bind_lanes(sys.modules[__name__])


# The label of the pass running now ("F3", "B1.c0"; "-" outside any). Process-wide, like the lane:
# a backward's collectives are issued on the autograd engine's thread on CUDA.
_LABEL = "-"


def current_label() -> str:
    lane = current_lane()
    return lane.label if lane is not None else _LABEL


class PassLabel:
    """Label the work done inside (one forward or backward step of one micro-batch)."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        global _LABEL
        self.prev, _LABEL = _LABEL, self.label
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        global _LABEL
        if HOOK is not None and current_lane() is None:
            HOOK.segment(self.label, "-", self.t0, time.perf_counter())
        _LABEL = self.prev
        return False


# ---------------------------------------------------------------------------------------------
# the two lanes
# ---------------------------------------------------------------------------------------------
_PAIR: Optional["Pair"] = None  # the pair running in this process (at most one at a time)


def current_lane() -> Optional["Lane"]:
    """The lane holding the baton, whichever thread asks (see the module doc)."""
    pair = _PAIR
    return pair.turn if pair is not None else None


def _rng_snapshot():
    from megatron.core import tensor_parallel

    state = [torch.get_rng_state(), None, None, None]
    if torch.cuda.is_available():
        state[1] = torch.cuda.get_rng_state()  # the current device's (set on every lane thread)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "states_", None) is not None:
        state[2] = tracker.get_states()
        state[3] = getattr(tracker, "_current_state_name", None)
    return state


def rng_equal(a, b) -> bool:
    """Two _rng_snapshot()s hold the same generator states."""
    def same(x, y):
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return all(same(x, y) for x, y in zip(a, b))


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


# Objects that keep state between the calls of one pass (megatron's shared-expert overlap state
# machine and its cached tensors, a token dispatcher's saved indices, splits and buffers): each
# lane sees its own copy of their per-call attributes, swapped at every hand-off like the RNG.
# Without it, a recompute re-entering a MoE layer's forward inside the paired backward, or the
# two passes of a pair on the same model chunk, overwrite each other's state mid-layer.
_STATEFUL: list = []  # (object, attribute names, or None: every attribute in its __dict__)
_MISSING = object()


def set_stateful(objects) -> None:
    _STATEFUL[:] = list(objects)


def _state_snapshot():
    return [(obj, dict(obj.__dict__) if attrs is None else {a: obj.__dict__.get(a, _MISSING) for a in attrs})
            for obj, attrs in _STATEFUL]


def _state_restore(snapshot) -> None:
    for obj, values in snapshot:
        for k, v in values.items():
            if v is _MISSING:
                obj.__dict__.pop(k, None)
            else:
                obj.__dict__[k] = v


class Lane:
    def __init__(self, name: str, pair: "Pair", label: str):
        self.name, self.pair, self.label = name, pair, label
        self.done = False
        self.rng = None
        self.objs = None  # this lane's view of the stateful objects (set_stateful)
        self.exc: Optional[BaseException] = None
        self.t_resumed = 0.0
        self.ep_in_flight = 0  # token all-to-alls issued and not yet waited for (waits_in_place)
        self.thread: Optional[threading.Thread] = None  # runs the lane's program (not its backward)

    @property
    def other(self) -> "Lane":
        return self.pair.b if self is self.pair.f else self.pair.f

    # The running lane gives the baton to the other one and blocks (whatever thread it is on)
    # until the baton comes back.
    def hand_off(self) -> bool:
        other = self.other
        if other.done:
            return False
        self._close_segment()
        self.rng = _rng_snapshot()
        self.objs = _state_snapshot()
        cv = self.pair.cv
        with cv:
            self.pair.turn = other
            self.pair.switches += 1
            cv.notify_all()
            cv.wait_for(lambda: self.pair.turn is self)
        _rng_restore(self.rng)
        _state_restore(self.objs)
        self.t_resumed = time.perf_counter()
        return True

    def _close_segment(self) -> None:
        if HOOK is not None:
            HOOK.segment(self.label, self.name, self.t_resumed, time.perf_counter())

    def finish(self) -> None:
        self._close_segment()
        self.rng = _rng_snapshot()
        self.objs = _state_snapshot()
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
    if parent["device"] is not None:
        torch.cuda.set_device(parent["device"])  # RNG snapshots, allocations: this rank's GPU
    for mode in parent["function_modes"]:
        torch._C._push_on_torch_function_stack(mode)
    for mode in parent["dispatch_modes"]:
        torch._C._push_on_torch_dispatch_stack(mode)
    torch.set_grad_enabled(parent["grad"])


def _capture_thread_state() -> dict:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return {
        "device": torch.cuda.current_device() if torch.cuda.is_available() else None,
        "function_modes": list(_get_current_function_mode_stack()),
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "grad": torch.is_grad_enabled(),
    }


class Pair:
    """Run ``fwd()`` (calling thread) and ``bwd()`` (helper thread) interleaved at collectives.

    Two forwards pair too (the pipeline's warmup, overlap_1f1b.py): the earlier one in the calling
    thread's lane, named "F", starts; the later one in the helper's, named "F2"; the process then
    continues from the later one's RNG and per-pass state. The earlier forward does every stretch
    between two collectives before the later one does the same stretch: the later lane runs only
    when the earlier one hands the baton over, and when it keeps going past a collective
    (waits_in_place: a TP collective while the earlier lane has a token all-to-all in flight) it
    stops at that all-to-all, where the earlier lane is. So whatever the two passes add to one
    accumulator (the MoE aux-loss tracker, expert token counts) is added in the plain order."""

    def __init__(self, fwd_label: str, bwd_label: str, two_forwards: bool = False):
        self.cv = threading.Condition()
        self.two_forwards = two_forwards
        self.f = Lane("F", self, fwd_label)
        self.b = Lane("F2" if two_forwards else "B", self, bwd_label)
        self.turn: Optional[Lane] = None
        self.switches = 0
        self.start_rng = None  # the RNG state the pair started from (run)

    def earlier_drew_random(self) -> bool:
        """After run() of two forwards: the earlier one changed a random generator's state (so the
        later one, started from the same state, drew other numbers than after it). SERIAL: in order."""
        return self.f.rng is not None and not rng_equal(self.start_rng, self.f.rng)

    # Diagnostics only: run the pair's forward then its backward in the calling thread, no hand-off
    # (same schedule order, no interleaving).
    SERIAL = False

    @staticmethod
    def backward_first() -> bool:
        """Which lane starts a pair: the backward where there is expert parallelism. A MoE layer's
        token all-to-all comes last in its forward and first in its backward, so started first the
        backward issues its all-to-all almost at once and the forward's attention computes behind
        it (started second, the forward's attention would run with nothing to hide). Without EP the
        forward starts: its first TP collective (the sequence-parallel all-gather before QKV) comes
        as early as the backward's, and measured, the forward-first order hides more of TP
        (docs/overlap.md). Every rank of a group has the same groups: the same choice everywhere."""
        return bool(GROUPS.ep)

    def run(self, fwd: Callable, bwd: Callable):
        global _PAIR
        if Pair.SERIAL:
            return fwd(), bwd()
        if _PAIR is not None:
            raise RuntimeError("lanes.Pair.run: a pair is already running in this process")
        _route_collectives_here()
        start_rng = self.start_rng = _rng_snapshot()
        start_objs = _state_snapshot()  # between passes: the backward starts from it, not mid-forward
        parent = _capture_thread_state()
        results = {}

        def b_main():
            _inherit_thread_state(parent)
            with self.cv:
                self.cv.wait_for(lambda: self.turn is self.b)
            _rng_restore(start_rng)
            _state_restore(start_objs)
            self.b.t_resumed = time.perf_counter()
            try:
                results["b"] = bwd()
            except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
                self.b.exc = e
            finally:
                self.b.finish()

        self.f.thread = threading.current_thread()
        self.b.thread = threading.Thread(target=b_main, name=f"overlap-{self.b.name}-{self.b.label}", daemon=True)
        backward_first = Pair.backward_first() and not self.two_forwards
        with self.cv:
            self.turn = self.b if backward_first else self.f
        _PAIR = self
        try:
            self.b.thread.start()
            if backward_first:
                with self.cv:
                    self.cv.wait_for(lambda: self.turn is self.f or self.b.done)
                _rng_restore(start_rng)  # the forward starts from the state the pair started from
                _state_restore(start_objs)
            self.f.t_resumed = time.perf_counter()
            try:
                results["f"] = fwd()
            except BaseException as e:  # noqa: BLE001
                self.f.exc = e
            finally:
                self.f.finish()
            with self.cv:
                self.cv.wait_for(lambda: self.b.done)
            self.b.thread.join()
        finally:
            _PAIR = None
        # Leave the process as the plain schedule would: the (later) forward's RNG stream continues.
        last = self.b if self.two_forwards else self.f
        _rng_restore(last.rng)
        _state_restore(last.objs)
        for lane in (self.f, self.b):
            if lane.exc is not None:
                raise lane.exc
        return results.get("f"), results.get("b")


# ---------------------------------------------------------------------------------------------
# the collective wrapper used by the seams
# ---------------------------------------------------------------------------------------------
def active() -> bool:
    return HOOK is not None or _PAIR is not None


class _Handle:
    """Stands in for a work handle megatron itself issued async (e.g. the dgrad all-reduce that
    megatron overlaps with the wgrad GEMM): its wait() first hands the baton over."""

    def __init__(self, work, token, lane: Optional[Lane], kind: str, in_place: bool = False):
        self._work, self._token, self._lane, self._kind = work, token, lane, kind
        self._in_place = in_place
        self._waited = False

    def wait(self, *args, **kwargs):
        if not self._waited:
            self._waited = True
            _finish(self._work, self._token, self._lane, self._kind, self._in_place)
        return True

    def is_completed(self):
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


# Time the compute waits for TP (and EP) collectives under our schedule, per group kind, for the
# log line. On CUDA, NCCL's wait() only makes the current stream wait: the time is taken with
# CUDA events around it on that stream and read when the log line asks (host time on CPU).
EXPOSED_S: dict = {}
_PENDING_EVENTS: list = []


def _timed_wait(work, kind: str):
    """work.wait(), timed. Returns (host t0, host t1, (event0, event1) on CUDA else None)."""
    events = None
    if torch.cuda.is_available():
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    t0 = time.perf_counter()
    work.wait()
    t1 = time.perf_counter()
    if events is not None:
        events[1].record()
        _PENDING_EVENTS.append((kind, events))
    else:
        EXPOSED_S[kind] = EXPOSED_S.get(kind, 0.0) + (t1 - t0)
    return t0, t1, events


def exposed_seconds() -> dict:
    """EXPOSED_S with the CUDA-event intervals recorded so far added (waits for them)."""
    while _PENDING_EVENTS:
        kind, (e0, e1) = _PENDING_EVENTS.pop()
        e1.synchronize()
        EXPOSED_S[kind] = EXPOSED_S.get(kind, 0.0) + e0.elapsed_time(e1) / 1e3
    return EXPOSED_S


def _token_all_to_all(lane: Optional[Lane], kind: Optional[str], in_place: bool) -> bool:
    """An EP collective a lane hands the baton over at: counted in the lane's ep_in_flight from
    its issue to its wait (waits_in_place)."""
    return lane is not None and kind == "ep" and not in_place


def _finish(work, token, lane: Optional[Lane], kind: str, in_place: bool = False) -> None:
    partner_done = lane is not None and lane.other.done
    handed = lane.hand_off() if lane is not None and not in_place else False
    if in_place and token is not None:
        token.in_place = True
    t0, t1, events = _timed_wait(work, kind)
    if _token_all_to_all(lane, kind, in_place):
        lane.ep_in_flight -= 1
    if HOOK is not None and token is not None:
        HOOK.collective_waited(token, t0, t1, events, handed, partner_done)


def row_width(t) -> int:
    """Elements per row (first dimension) of a collective's payload."""
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def collective(op: str, group, nbytes: int, start: Callable[[], object], async_op: bool,
               width: Optional[int] = None):
    """Issue ``start()`` (which must launch the collective with async_op=True). For a caller that
    asked for a blocking collective, hand the baton over and wait here; for one that asked for an
    async handle, return a handle that does the same in wait(). ``width``: elements per row of the
    payload (is_metadata)."""
    kind = group_kind(group)
    lane = current_lane()
    in_place = waits_in_place(kind, width, lane)
    hook = HOOK
    if kind is None or (lane is None and hook is None):
        return None  # caller falls back to the original call
    if _token_all_to_all(lane, kind, in_place):
        lane.ep_in_flight += 1
    token = None
    if hook is not None:
        token = hook.collective_issued(op, kind, nbytes, current_label(),
                                       lane.name if lane else "-", async_op)
    work = start()
    if token is not None:
        try:
            work.get_future().add_done_callback(lambda _f, t=token, h=hook: h.collective_done(t))
        except Exception:  # noqa: BLE001 - backends without futures: completion = wait end
            pass
    if async_op:
        return _Handle(work, token, lane, kind, in_place)
    _finish(work, token, lane, kind, in_place)
    return SYNC_DONE


SYNC_DONE = object()

