"""The CPU copy engine of the CUDA-faithful mode (megatron_ext/platform/streams.py): side-stream work
runs later on a worker at the modelled link bandwidth, events complete only when the worker reaches
them, and the compute stream (the host) waiting on an event blocks until then."""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from megatron_ext.platform import faithful, streams


@contextlib.contextmanager
def _link(gbps):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faithful.ENV, "1")
        mp.setenv(faithful.LINK_ENV, str(gbps))
        yield


@contextlib.contextmanager
def _streams(n, **kw):
    made = [streams.Stream(**kw) for _ in range(n)]
    try:
        yield made
    finally:
        for s in made:
            s.close()
    assert all(s.raw._thread is None for s in made)  # every worker joined


def _copy(dst, src):
    return lambda: dst.copy_(src)


def test_copy_runs_later_query_false_until_done_and_wait_blocks():
    src, dst = torch.arange(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    with _link(0.005), _streams(1) as (side,):  # 1 MiB at 0.005 GB/s: ~0.21 s on the link
        t0 = time.perf_counter()
        side.run(_copy(dst, src), nbytes=src.numel())  # the host only enqueues it
        done = side.record()
        assert not done.query() and not torch.equal(dst, src)  # not there yet
        done.wait(streams.Stream.current())  # the compute stream is the host: this blocks
        waited = time.perf_counter() - t0
        assert done.query() and torch.equal(dst, src)
        assert waited >= src.numel() / 0.005e9


def test_bandwidth_is_honoured():
    n = 4 << 20
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    took = {}
    for gbps in (0.02, 0.05):
        with _link(gbps), _streams(1) as (side,):
            t0 = time.perf_counter()
            for i in range(4):
                side.run(_copy(dst[i * n // 4:(i + 1) * n // 4], src[i * n // 4:(i + 1) * n // 4]), nbytes=n // 4)
            side.synchronize()
            took[gbps] = time.perf_counter() - t0
            model = n / (gbps * 1e9)  # 0.21 s / 0.084 s
            # never faster than the link; the slack above it is thread wake-ups on a busy host
            assert model <= took[gbps] <= 3 * model + 0.5, (gbps, took[gbps], model)
    assert took[0.02] > took[0.05]


def test_two_streams_ordered_by_an_event():
    log = []
    a_src = torch.ones(1 << 20, dtype=torch.uint8)
    buf = torch.zeros_like(a_src)
    with _link(0.005), _streams(2) as (a, b):  # a's copy: ~0.21 s on the link
        a.run(lambda: (buf.copy_(a_src), log.append(("a", time.perf_counter()))), nbytes=a_src.numel())
        ev = a.record()
        ev.wait(b)  # b's later work runs after a's copy, and the host does not block
        b.run(lambda: log.append(("b", time.perf_counter(), int(buf.sum()))))
        assert log == [] and not b.record().query()
        b.synchronize()
        assert [x[0] for x in log] == ["a", "b"]
        assert log[1][2] == a_src.numel()  # b saw a's copy complete
        # without the event, b's work runs at once, long before a's slow copy lands
        log.clear()
        a.run(lambda: log.append("a2"), nbytes=a_src.numel())
        b.run(lambda: log.append("b2"))
        b.synchronize()
        assert log == ["b2"]
        a.synchronize()
        assert log == ["b2", "a2"]


def test_error_in_queued_work_surfaces_at_the_next_wait():
    with _link(10), _streams(1) as (side,):
        side.run(lambda: torch.zeros(2).copy_(torch.zeros(3)))
        ev = side.record()
        with pytest.raises(RuntimeError, match="size of tensor"):
            ev.wait(streams.Stream.current())


def test_deferred_stream_runs_only_when_waited_on_and_query_never_forces():
    box = []
    with _streams(1, deferred=True) as (s,):
        s.run(lambda: box.append(1))
        ev = s.record()
        time.sleep(0.02)
        assert not ev.query() and box == []  # a host poll never sees it (the slowest possible device)
        ev.synchronize()
        assert box == [1] and ev.query()


def test_one_stand_in_for_megatron_and_ours():
    # torch.cuda.Stream/Event are the same CPU classes, and torch.cuda.synchronize waits for queued work
    assert torch.cuda.Stream is streams.CpuStream and torch.cuda.Event is streams.CpuEvent
    assert streams.Stream.current().raw is torch.cuda.current_stream()
    box = []
    with _link(0.05), _streams(1) as (side,):
        side.run(lambda: box.append(1), nbytes=1 << 20)
        torch.cuda.synchronize()
        assert box == [1]
    assert streams.worker_threads() == 0


def test_plain_cpu_mode_runs_side_stream_work_inline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(faithful.ENV, "0")
        box = []
        with _streams(1) as (s,):
            s.run(lambda: box.append(1), nbytes=1 << 30)
            assert box == [1] and s.record().query() and s.raw._thread is None
