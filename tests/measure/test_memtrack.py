"""The measuring tools beside what a CUDA process holds: a dead ``weakref.proxy`` among the objects
the garbage collector tracks broke the tracker's walk (``isinstance`` reads ``__class__`` through the
proxy: ``ReferenceError``), and with it the planner and every entry point that tracks live bytes."""
from __future__ import annotations

import ast
import os
import weakref

import pytest
import torch

from megatron_ext.measure.memtrack import LiveBytesTracker, live_tensors
from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tracker_walks_past_a_dead_weak_proxy():
    class Gone:
        pass

    target = Gone()
    proxy = weakref.proxy(target)
    del target
    kept = torch.ones(1000)
    assert any(t is kept for t in live_tensors())  # the walk finds tensors, and passes the dead proxy
    with LiveBytesTracker() as tracker:
        y = kept * 2  # a new storage: counted; `kept` was alive at the start: not counted
    assert tracker.peak == y.untyped_storage().nbytes()
    del proxy


def _steps():
    """Allocations, frees, views and addresses reused by new storages: the live bytes after each step,
    counted by hand."""
    n = 4 * 256
    a = torch.ones(256)  # +n
    b = a * 2  # +n
    yield 2 * n
    v = b.view(16, 16).t()  # a view: no new storage
    del a
    c = v + 1  # +n, possibly at a's address
    yield 2 * n
    del b, v
    d = c.sum(0, keepdim=True)  # b's storage died: only found at this allocating op
    yield n + 64
    del c, d
    e = [torch.ones(64) for _ in range(8)]  # the freed addresses reused
    yield 8 * 256
    del e


def test_the_peak_is_the_same_when_only_allocating_ops_sweep():
    """Between two ops that allocate or grow a storage the live bytes can only fall: sweeping the dead
    storages at those ops alone finds the peak a sweep after every op finds."""
    peaks = []
    for every in (True, False):
        tracker = LiveBytesTracker()
        tracker.sweep_every_op = every
        with tracker:
            highest = max(_steps())
            tracker.sample()
        peaks.append(tracker.peak)
        assert tracker.current == 0
    assert peaks == [highest, highest], peaks


def test_a_new_storage_at_a_dead_ones_address_is_counted():
    """The allocator hands a freed address to the next storage of its size: the tracker must not take
    the new storage for the dead one it has not swept yet (in a pool worker: a process whose heap is
    the same from run to run)."""
    found = run_distributed(1, "tests.measure.jobs:storage_at_a_dead_ones_address")[0]
    assert found["reused"], "the freed address was never handed out again: nothing checked"
    assert found["live"] == found["peak"] == found["expected"], found


def test_planner_and_its_measurement_run_beside_a_dead_weak_proxy():
    (r,) = run_distributed(1, "tests.measure.jobs:planner_beside_a_dead_weak_proxy",
                           argv=["--recipe", "recipes/tiny_dense.yaml"])
    assert r["proxy_seen"]
    assert abs(r["predicted"] - r["measured"]) <= 0.05 * r["measured"], r


def _calls_get_objects(path: str) -> list:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("get_objects", "get_referrers", "get_referents")]


def test_every_walk_over_the_garbage_collector_is_the_safe_one():
    """The guard that sees every entry point: scripts/, train.py and the package reach the objects the
    garbage collector tracks only through ``memtrack.live_tensors``."""
    found = {}
    for top in ("megatron_ext", "scripts", "train.py"):
        path = os.path.join(ROOT, top)
        files = [path] if path.endswith(".py") else [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
        for file in files:
            lines = _calls_get_objects(file)
            if lines:
                found[os.path.relpath(file, ROOT)] = lines
    assert list(found) == [os.path.join("megatron_ext", "measure", "memtrack.py")], found
    assert len(found[os.path.join("megatron_ext", "measure", "memtrack.py")]) == 1
