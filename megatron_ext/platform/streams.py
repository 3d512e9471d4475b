"""Streams and events behind one small interface, with the one CPU stand-in.

On CUDA ``Stream`` / ``Event`` wrap real ``torch.cuda`` streams and events. Without CUDA they wrap
``CpuStream`` / ``CpuEvent``, which are also what ``torch.cuda.Stream`` / ``torch.cuda.Event`` become
under the CPU shims (``cpu_shims/``), so megatron-core's streams and ours are the same objects.
Scheduling code (offload, overlap) is written once against this.

The CPU model. The host is the compute stream: what it runs is done when it returns, so an event
recorded there is complete at once. A side stream is one of:

* immediate (plain CPU mode): work given to ``Stream.run`` runs at once, inline;
* asynchronous (the CUDA-faithful CPU mode, ``faithful.enabled()``): work is queued and runs later,
  in order, on the stream's own worker thread, and a copy of N bytes takes N / link bandwidth
  (``faithful.link_gbps()``; each stream is one direction of a full-duplex link). An event completes
  only when the worker reaches it: ``query()`` is false until then, a stream that waits on it holds
  its later work back, and the compute stream (the host) waiting on it blocks until it completes;
* deferred (``Stream(deferred=True)``, the debug mode of a caller): queued work runs only when an
  event recorded after it is waited on or synchronized (``query()`` never forces it), i.e. as late as
  a device could run it, so a missing wait reads stale data deterministically.

An exception raised by queued work is kept by its stream and re-raised on the host by the next wait
or synchronize that depends on it (as a CUDA error surfaces at the next synchronizing call). Worker
threads start on first use and stop in ``close()`` (``shutdown()`` stops every one left).
``host_empty`` allocates host staging memory (pinned on CUDA).
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import math
import threading
import time
import weakref

import torch

from megatron_ext.platform import faithful


def cuda() -> bool:
    return torch.cuda.is_available()


_COND = threading.Condition()  # one lock for the CPU engine: every stream's progress and demand
_WORKERS: "weakref.WeakSet[CpuStream]" = weakref.WeakSet()


class CpuStream(torch.Stream):
    """Stand-in for ``torch.cuda.Stream`` (a real CPU ``torch.Stream``, so torch's argument parser
    accepts it, e.g. in ``Tensor.record_stream``), and the CPU side of :class:`Stream`."""

    def __new__(cls, *_, **__):
        return super().__new__(cls, "cpu")

    def __init__(self, priority: int = 0, *_, deferred: bool = False, host: bool = False, **__):
        self._host = host
        self._deferred = deferred and not host
        self._queued = not host and (deferred or faithful.enabled())
        self._ops: collections.deque = collections.deque()  # (index, fn, seconds)
        self._submitted = 0  # ops given so far; an event marks an index among them
        self._done = 0  # ops finished
        self._demand = 0  # deferred: ops the worker may run
        self._error: BaseException | None = None
        self._timed: list = []  # events waiting for a completion timestamp
        self._thread: threading.Thread | None = None
        self._closing = False

    # ----------------------------------------------------------------- queue
    def submit(self, fn, nbytes: int = 0) -> None:
        """Issue ``fn`` on this stream; a copy of ``nbytes`` is paced by the link bandwidth."""
        if not self._queued:
            fn()
            return
        gbps = faithful.link_gbps() if faithful.enabled() else math.inf
        seconds = nbytes / (gbps * 1e9) if nbytes and gbps > 0 and math.isfinite(gbps) else 0.0
        with _COND:
            self._submitted += 1
            self._ops.append((self._submitted, fn, seconds))
            if not self._deferred:
                self._demand = self._submitted
            if self._thread is None:
                self._closing = False
                self._thread = threading.Thread(target=self._work, name="megatron_ext-cpu-stream", daemon=True)
                _WORKERS.add(self)
                self._thread.start()
            _COND.notify_all()

    def _work(self) -> None:
        while True:
            with _COND:
                while not (self._ops and self._ops[0][0] <= self._demand) and not self._closing:
                    _COND.wait()
                if not self._ops:
                    return
                index, fn, seconds = self._ops.popleft()
                failed = self._error is not None
            err = None
            if not failed:  # after an error the stream only drains (as a CUDA error is sticky)
                try:
                    if seconds:
                        time.sleep(seconds)  # the data lands at the end of the transfer
                    fn()
                except BaseException as e:  # noqa: BLE001 - surfaced on the host at the next wait
                    err = e
            fn = None  # let go of what the work held (e.g. a released device storage) before completing
            with _COND:
                if err is not None and self._error is None:
                    self._error = err
                self._done = index
                if self._timed:
                    now = time.perf_counter()
                    for ev in [e for e in self._timed if e._index <= index]:
                        ev._time = now
                        self._timed.remove(ev)
                _COND.notify_all()

    def _wait_until(self, index: int) -> None:
        """Block the calling thread until op ``index`` has finished; re-raise the stream's error."""
        if self._queued and index > self._done:
            with _COND:
                if index > self._demand:
                    self._demand = index
                    _COND.notify_all()
                while self._done < index:
                    _COND.wait()
        if self._error is not None:
            raise self._error

    # ----------------------------------------------------------------- torch.cuda.Stream API
    def wait_event(self, event: "CpuEvent") -> None:
        event.wait(self)

    def wait_stream(self, other: "CpuStream") -> None:
        CpuEvent().record(other).wait(self)

    def record_event(self, event: "CpuEvent | None" = None) -> "CpuEvent":
        return (event or CpuEvent()).record(self)

    def synchronize(self) -> None:
        self._wait_until(self._submitted)

    def query(self) -> bool:
        return self._done >= self._submitted

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # ----------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Finish the queued work and stop the worker thread (joined). Errors are not raised here."""
        thread = self._thread
        if thread is None:
            return
        with _COND:
            self._demand = self._submitted
            self._closing = True
            _COND.notify_all()
        thread.join()
        self._thread = None
        _WORKERS.discard(self)


class CpuEvent:
    """Stand-in for ``torch.cuda.Event``: marks a point in a :class:`CpuStream`'s queue."""

    def __init__(self, enable_timing: bool = False, *_, **__):
        self._stream: CpuStream | None = None
        self._index = 0
        self._timing = enable_timing
        self._time: float | None = None

    def record(self, stream: CpuStream | None = None) -> "CpuEvent":
        stream = stream if stream is not None else host_stream()
        with _COND:
            self._stream, self._index = stream, stream._submitted
            self._time = None
            if stream._done >= self._index:
                self._time = time.perf_counter()
            elif self._timing:
                stream._timed.append(self)
        return self

    def query(self) -> bool:
        s = self._stream
        if s is not None and s._error is not None:
            raise s._error
        return s is None or s._done >= self._index

    def _block(self) -> None:
        if self._stream is not None:
            self._stream._wait_until(self._index)

    def synchronize(self) -> None:
        self._block()

    def wait(self, stream: CpuStream | None = None) -> None:
        """Make ``stream`` (default: the host, i.e. the compute stream) wait for this event: a
        queued stream holds its later work back; the host blocks until the event completes."""
        stream = stream if stream is not None else host_stream()
        if self._stream is None or self._stream is stream or self.query():
            return
        if stream._queued:
            stream.submit(self._block)
        else:
            self._block()

    def elapsed_time(self, end: "CpuEvent") -> float:
        """Milliseconds between this event's completion and ``end``'s (both must have completed)."""
        self._block(), end._block()
        if self._time is None or end._time is None:
            return 0.0
        return (end._time - self._time) * 1e3


_HOST = CpuStream(host=True)


def host_stream() -> CpuStream:
    """The CPU compute stream: the host itself."""
    return _HOST


@atexit.register
def shutdown() -> None:
    """Stop every CPU stream worker still running (streams are normally closed by their owner)."""
    for s in list(_WORKERS):
        s.close()


def synchronize_all() -> None:
    """``torch.cuda.synchronize`` on CPU: wait for the work queued on every CPU stream."""
    for s in list(_WORKERS):
        s.synchronize()


def worker_threads() -> int:
    """CPU stream worker threads alive now (tests check that none is left behind)."""
    return sum(1 for s in list(_WORKERS) if s._thread is not None and s._thread.is_alive())


# --------------------------------------------------------------------------- the project's interface
class Event:
    def __init__(self, enable_timing: bool = False):
        self.raw = torch.cuda.Event(enable_timing=enable_timing) if cuda() else CpuEvent(enable_timing)

    def record(self, stream: "Stream | None" = None) -> "Event":
        self.raw.record(stream.raw if stream is not None else None)
        return self

    def wait(self, stream: "Stream | None" = None) -> None:
        """Make ``stream`` (default: current) wait for this event. On CUDA the host does not block;
        on CPU the compute stream is the host, which blocks until the event completes."""
        self.raw.wait(stream.raw if stream is not None else None)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        """True once the work before the event has run (never forces it)."""
        return self.raw.query()

    def elapsed_time(self, end: "Event") -> float:
        return self.raw.elapsed_time(end.raw)


class Stream:
    def __init__(self, priority: int = 0, raw=None, deferred: bool = False):
        if raw is None:
            raw = torch.cuda.Stream(priority=priority) if cuda() else CpuStream(priority, deferred=deferred)
        self.raw = raw

    @classmethod
    def current(cls) -> "Stream":
        return cls(raw=torch.cuda.current_stream() if cuda() else host_stream())

    def context(self):
        return torch.cuda.stream(self.raw) if cuda() else contextlib.nullcontext()

    def wait(self, other: "Stream") -> None:
        self.raw.wait_stream(other.raw)

    def run(self, fn, nbytes: int = 0) -> None:
        """Issue ``fn``'s device work on this stream. ``nbytes``: bytes it moves over the host link
        (paces the CPU model; on CUDA the hardware does)."""
        if cuda():
            with self.context():
                fn()
        else:
            self.raw.submit(fn, nbytes)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def record(self) -> Event:
        return Event().record(self)

    def close(self) -> None:
        """Finish queued work and stop the CPU worker thread (nothing to do on CUDA)."""
        if isinstance(self.raw, CpuStream):
            self.raw.close()


def pin_memory_available() -> bool:
    return cuda()


def host_empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 host buffer for device<->host staging: pinned on CUDA (async copies need it)."""
    return torch.empty(int(nbytes), dtype=torch.uint8, device="cpu", pin_memory=pin_memory_available())
