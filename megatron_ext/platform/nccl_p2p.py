"""CUDA-faithful CPU mode, part (b): point-to-point messages follow NCCL's rules, not gloo's.

NCCL runs the single sends and receives between two ranks of a process group on one communicator
per (group, rank pair), shared by both directions, and executes its operations in issue order; a
send completes only once the peer's matching receive runs (and vice versa), beyond a small internal
buffer. Ops grouped by ``batch_isend_irecv`` (ncclGroupStart/End) run as one unit on the group's
collective communicator. gloo instead matches each (source, tag) on its own, in any order.

In the faithful mode every single ``isend`` / ``irecv`` / ``send`` / ``recv`` is queued on a
stand-in communicator for its (group, rank pair), whose thread runs the queue in issue order. An
op at the head first meets its peer's matching op (the n-th send from a to b meets b's n-th receive
from a; both sides mark "ready" in the job's key-value store and wait for the other's mark), then
moves the data with gloo on a tag of its own. User tags are ignored for matching, as on NCCL, so a
wrong order delivers the wrong tensor. Grouped ops pass through to gloo unchanged: NCCL runs a
group as one unit whose sends and receives do not wait for one another's order.

A deadlock is detected, not just suffered: a monitor thread looks at every communicator whose head
op has waited POLL_S, publishes that side's state in the store (head op, completed counts, pending
ops) and reads the peer's. Both heads of one communicator being sends (or both receives) with
consistent counts is a proven deadlock: neither can complete and everything behind them is ordered
after them. The communicator then fails, and every wait on its ops raises P2PDeadlock naming both
ranks' pending ops, on both ranks. Anything else stuck for DEADLOCK_S is reported the same way.
An aborted op never reached gloo, so the process group stays usable.

Upstream sites it covers: megatron/core/pipeline_parallel/p2p_communication.py:79-117
(_p2p_ops: isend/irecv, the WORLD group for one direction when the pipeline group has 2 ranks) and
:41-56 (_batched_p2p_ops: batch_isend_irecv, passed through).
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_ext.platform import faithful

POLL_S = 1.0  # a head op blocked this long takes part in deadlock detection
DEADLOCK_S = float(os.environ.get("MEGATRON_EXT_P2P_DEADLOCK_S", "60"))
DATA_TAG = 0x4E43  # gloo tag of every simulated message (user tags are ignored, as on NCCL)
PREFIX = "megatron_ext/nccl_p2p"
ABORT = b"abort"

TRACE: Optional[list] = None  # when a list: ("op", id, kind, peer, group name, tag) / ("wait", id)


class P2PDeadlock(RuntimeError):
    pass


def _fresh(error: BaseException) -> BaseException:
    """A new exception like `error` for each raise: the stored one never carries a traceback, whose
    frames would keep the raiser's tensors and process groups alive."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a type that cannot be rebuilt from its args
        return RuntimeError(str(error))


_ORIG: Dict[str, Callable] = {}
_COMMS: dict = {}
_COMMS_LOCK = threading.Lock()
_IDS = iter(range(1 << 62))
_local = threading.local()  # only for the batch_isend_irecv pass-through, set and read on one thread


# ---------------------------------------------------------------------------------------------
# store clients: one per communicator thread at a time (a blocking wait holds its client)
# ---------------------------------------------------------------------------------------------
_STORES: List = []
_STORES_LOCK = threading.Lock()


def _store_client():
    with _STORES_LOCK:
        if _STORES:
            return _STORES.pop()
    base = c10d._get_default_store()
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    client = dist.TCPStore(base.host, base.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=max(DEADLOCK_S, 30)))
    # under this attempt's prefix (platform.init_distributed): a restarted world must not read the
    # marks a killed attempt left in the same store
    from megatron_ext.platform.attempts import store_prefix

    return dist.PrefixStore(f"{store_prefix()}/{PREFIX}", client)


def _release_store(store) -> None:
    with _STORES_LOCK:
        _STORES.append(store)


# ---------------------------------------------------------------------------------------------
# the stand-in communicator of one (group, rank pair)
# ---------------------------------------------------------------------------------------------
class _Op:
    def __init__(self, kind: str, peer: int, tensor: torch.Tensor, tag: int, group):
        self.id = next(_IDS)
        self.kind, self.peer, self.tensor, self.tag = kind, peer, tensor, tag
        self.group = group  # held only while the op is pending: a destroyed group must be freed
        self.seq = -1
        self.work = SimWork(self)

    def describe(self) -> str:
        arrow = f"send to {self.peer}" if self.kind == "send" else f"recv from {self.peer}"
        return (f"{arrow} #{self.seq} (tag {self.tag}, {tuple(self.tensor.shape)} "
                f"{str(self.tensor.dtype).replace('torch.', '')})")


class _Comm:
    def __init__(self, group_name: str, me: int, peer: int):
        self.group_name, self.me, self.peer = group_name, me, peer
        self.name = f"{group_name}:{min(me, peer)}-{max(me, peer)}"
        self.lock = threading.Lock()
        self.queue: deque = deque()
        self.thread: Optional[threading.Thread] = None
        self.issued = {"send": 0, "recv": 0}
        self.done = {"send": 0, "recv": 0}
        self.error: Optional[BaseException] = None
        self.waiting = None  # (head op, the peer's key it waits for, since)

    def submit(self, op: _Op) -> None:
        with self.lock:
            if self.error is not None:
                raise _fresh(self.error)
            op.seq = self.issued[op.kind]
            self.issued[op.kind] += 1
            self.queue.append(op)
            if self.thread is None:
                self.thread = threading.Thread(target=self._main, name=f"nccl-p2p {self.name}",
                                               daemon=True)
                self.thread.start()

    def _key(self, op: _Op, side: str) -> str:
        src, dst = (self.me, op.peer) if op.kind == "send" else (op.peer, self.me)
        return f"{self.group_name}/{src}>{dst}/{op.seq}/{side}"

    def _main(self) -> None:
        store = _store_client()
        try:
            while True:
                with self.lock:
                    if not self.queue or self.error is not None:
                        self.thread = None
                        _WAKE.set()  # the monitor stops once no communicator thread runs
                        return
                    op = self.queue[0]
                self._run(store, op)
                with self.lock:
                    self.queue.popleft()
                    self.done[op.kind] += 1
                op.work._finish(None)
        except BaseException as e:  # noqa: BLE001 - every waiter gets it
            self._fail(_fresh(e))
        finally:
            _release_store(store)

    def _run(self, store, op: _Op) -> None:
        mine, theirs = ("s", "r") if op.kind == "send" else ("r", "s")
        key = self._key(op, theirs)
        store.set(self._key(op, mine), b"1")
        with self.lock:
            self.waiting = (op, key, time.monotonic())
        _monitor()
        try:
            store.wait([key], datetime.timedelta(seconds=DEADLOCK_S + 60))
            value = store.get(key)
        finally:
            with self.lock:
                self.waiting = None
        if self.error is not None or value == ABORT:
            raise _fresh(self.error) if self.error is not None else P2PDeadlock(f"{self.name}: aborted")
        store.delete_key(key)
        group_peer = dist.get_group_rank(op.group, op.peer)
        if op.kind == "send":
            _ORIG["isend"](op.tensor, group=op.group, tag=DATA_TAG, group_dst=group_peer).wait()
        else:
            _ORIG["irecv"](op.tensor, group=op.group, tag=DATA_TAG, group_src=group_peer).wait()

    def inspect(self, store, now: float) -> None:
        """Monitor: if the head has waited POLL_S, publish this side's state and compare it with
        the peer's; on a proven deadlock (or none of progress for DEADLOCK_S) fail this
        communicator and wake its thread."""
        with self.lock:
            if self.waiting is None or self.error is not None:
                return
            op, key, since = self.waiting
        if now - since < POLL_S:
            return
        mine = self._state(op)
        store.set(f"{self.name}/state/{self.me}", json.dumps(mine))
        theirs = self._peer_state(store)
        if theirs is not None and _head_to_head(mine, theirs):
            error = P2PDeadlock(self._report(f"deadlock: both heads are {op.kind}s, neither can "
                                             "complete", mine, theirs))
        elif now - since > DEADLOCK_S:
            error = P2PDeadlock(self._report(f"no progress for {DEADLOCK_S:.0f} s", mine, theirs))
        else:
            return
        with self.lock:
            if self.error is None:
                self.error = error
        store.set(key, ABORT)

    def _state(self, op: _Op) -> dict:
        with self.lock:
            pending = [o.describe() for o in self.queue]
            return {"rank": self.me, "head": op.kind, "sent": self.done["send"],
                    "received": self.done["recv"], "pending": pending}

    def _peer_state(self, store) -> Optional[dict]:
        key = f"{self.name}/state/{self.peer}"
        if not store.check([key]):
            return None
        return json.loads(store.get(key))

    def _report(self, what: str, mine: dict, theirs: Optional[dict]) -> str:
        lines = [f"NCCL p2p {what} on the communicator of group {self.group_name} between "
                 f"ranks {min(self.me, self.peer)} and {max(self.me, self.peer)}:"]
        for state in (mine, theirs):
            if state is not None:
                lines.append(f"  rank {state['rank']} (completed: {state['sent']} sends, "
                             f"{state['received']} recvs) pending: " + "; ".join(state["pending"]))
        if theirs is None:
            lines.append(f"  rank {self.peer}: nothing published (its host has not queued an op here)")
        return "\n".join(lines)

    def _fail(self, error: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = error
            failed, self.queue = list(self.queue), deque()
            self.thread = None
        _WAKE.set()
        for op in failed:
            op.work._finish(self.error)


def _head_to_head(mine: dict, theirs: dict) -> bool:
    """Both heads the same kind (two sends, or two receives) and the peer's record is current:
    no op completed on this communicator since it was written (counts agree)."""
    return (mine["head"] == theirs["head"] and theirs["sent"] == mine["received"]
            and theirs["received"] == mine["sent"])


class SimWork:
    """The request handed back for a simulated op: wait() blocks the caller until it completed."""

    def __init__(self, op: _Op):
        self._op = op
        self._event = threading.Event()
        self._error: Optional[BaseException] = None
        self._traced = False

    def _finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._event.set()
        self._op.tensor = self._op.group = None  # delivered (or failed): let go of them

    def wait(self, timeout=None) -> bool:
        trace = TRACE
        if trace is not None and not self._traced:
            self._traced = True
            trace.append(("wait", self._op.id))
        self._event.wait()
        if self._error is not None:
            raise _fresh(self._error)
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self):
        return self._error


_MONITOR: Optional[threading.Thread] = None
_WAKE = threading.Event()


def _monitor() -> None:
    """Start the process's deadlock monitor unless it runs; it stops once nothing waits."""
    global _MONITOR
    with _COMMS_LOCK:
        if _MONITOR is not None and _MONITOR.is_alive():
            return
        _MONITOR = threading.Thread(target=_monitor_main, name="nccl-p2p monitor", daemon=True)
        _MONITOR.start()


def _monitor_main() -> None:
    global _MONITOR
    store = _store_client()
    try:
        while True:
            _WAKE.wait(POLL_S / 2)
            _WAKE.clear()
            with _COMMS_LOCK:
                comms = list(_COMMS.values())
                if not any(c.thread is not None for c in comms):
                    _MONITOR = None
                    return
            now = time.monotonic()
            for comm in comms:
                comm.inspect(store, now)
    finally:
        _release_store(store)


def _comm(group, peer: int) -> _Comm:
    """Group names are unique within a process's life (new_group numbers them), so a destroyed
    group's communicator is never reused for a new group."""
    me = dist.get_rank()
    key = (group.group_name, min(me, peer), max(me, peer))
    with _COMMS_LOCK:
        comm = _COMMS.get(key)
        if comm is None:
            comm = _COMMS[key] = _Comm(group.group_name, me, peer)
        return comm


def _simulated(tensor) -> bool:
    return faithful.enabled() and not getattr(_local, "batched", False) and not tensor.is_cuda


def _issue(kind: str, tensor, peer, group, tag, group_peer):
    group = group if group is not None else c10d._get_default_group()
    if peer is None:
        peer = dist.get_global_rank(group, group_peer)
    # NCCL reads the buffer when the op runs; the caller may re-point the tensor meanwhile
    # (megatron's deallocate_output_tensor sets .data after a send): keep this storage
    op = _Op(kind, peer, tensor.detach() if kind == "send" else tensor, tag, group)
    trace = TRACE
    if trace is not None:
        trace.append(("op", op.id, kind, peer, group.group_name, tag))
    _comm(group, peer).submit(op)
    return op.work


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    if not _simulated(tensor):
        return _ORIG["isend"](tensor, dst, group, tag, group_dst=group_dst)
    return _issue("send", tensor, dst, group, tag, group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if not _simulated(tensor) or (src is None and group_src is None):
        return _ORIG["irecv"](tensor, src, group, tag, group_src=group_src)
    return _issue("recv", tensor, src, group, tag, group_src)


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    if not _simulated(tensor):
        return _ORIG["send"](tensor, dst, group, tag, group_dst=group_dst)
    _issue("send", tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if not _simulated(tensor) or (src is None and group_src is None):
        return _ORIG["recv"](tensor, src, group, tag, group_src=group_src)
    work = _issue("recv", tensor, src, group, tag, group_src)
    work.wait()
    return work._op.peer


def batch_isend_irecv(p2p_op_list):
    _local.batched = True
    try:
        return _ORIG["batch_isend_irecv"](p2p_op_list)
    finally:
        _local.batched = False


def _forget_after_fork() -> None:
    """A forked child (e.g. an async checkpoint writer) has none of the parent's threads."""
    global _MONITOR
    _COMMS.clear()
    _STORES.clear()
    _MONITOR = None


os.register_at_fork(after_in_child=_forget_after_fork)

_WRAPPERS = {"isend": isend, "irecv": irecv, "send": send, "recv": recv,
             "batch_isend_irecv": batch_isend_irecv}


def install() -> Callable[[], None]:
    """Replace the p2p functions in torch.distributed (and in distributed_c10d, whose P2POp checks
    its op against them). Returns the uninstaller."""
    if _ORIG:
        return lambda: None
    for name, fn in _WRAPPERS.items():
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)

    def undo():
        for name, fn in _ORIG.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        _ORIG.clear()

    return undo

