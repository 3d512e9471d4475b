"""The measuring tools beside what a CUDA process holds: a dead ``weakref.proxy`` among the objects
the garbage collector tracks broke the tracker's walk (``isinstance`` reads ``__class__`` through the
proxy: ``ReferenceError``), and with it the planner and every entry point that tracks live bytes."""
from __future__ import annotations

import ast
import os
import weakref

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
