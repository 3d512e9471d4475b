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

Beside this module: which groups' collectives hand the baton over and which wait in place
(group_kinds.py), what each lane keeps of the process's state (lane_state.py), and the time the
compute waited for the collectives (exposed_comm.py).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

from megatron_ext.schedules import exposed_comm, lane_state
from megatron_ext.schedules.group_kinds import GROUPS, group_kind, waits_in_place


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
        self.rng = lane_state.rng_snapshot()
        self.objs = lane_state.state_snapshot()
        cv = self.pair.cv
        with cv:
            self.pair.turn = other
            self.pair.switches += 1
            cv.notify_all()
            cv.wait_for(lambda: self.pair.turn is self)
        lane_state.rng_restore(self.rng)
        lane_state.state_restore(self.objs)
        self.t_resumed = time.perf_counter()
        return True

    def _close_segment(self) -> None:
        if HOOK is not None:
            HOOK.segment(self.label, self.name, self.t_resumed, time.perf_counter())

    def finish(self) -> None:
        self._close_segment()
        self.rng = lane_state.rng_snapshot()
        self.objs = lane_state.state_snapshot()
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
        return self.f.rng is not None and not lane_state.rng_equal(self.start_rng, self.f.rng)

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
        start_rng = self.start_rng = lane_state.rng_snapshot()
        start_objs = lane_state.state_snapshot()  # between passes: the backward starts from it, not mid-forward
        parent = lane_state.capture_thread_state()
        results = {}

        def b_main():
            lane_state.inherit_thread_state(parent)
            with self.cv:
                self.cv.wait_for(lambda: self.turn is self.b)
            lane_state.rng_restore(start_rng)
            lane_state.state_restore(start_objs)
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
                lane_state.rng_restore(start_rng)  # the forward starts from the state the pair started from
                lane_state.state_restore(start_objs)
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
        lane_state.rng_restore(last.rng)
        lane_state.state_restore(last.objs)
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


def _token_all_to_all(lane: Optional[Lane], kind: Optional[str], in_place: bool) -> bool:
    """An EP collective a lane hands the baton over at: counted in the lane's ep_in_flight from
    its issue to its wait (waits_in_place)."""
    return lane is not None and kind == "ep" and not in_place


def _finish(work, token, lane: Optional[Lane], kind: str, in_place: bool = False) -> None:
    partner_done = lane is not None and lane.other.done
    handed = lane.hand_off() if lane is not None and not in_place else False
    if in_place and token is not None:
        token.in_place = True
    t0, t1, events = exposed_comm.timed_wait(work, kind)
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
