"""Job functions for the measuring tools' tests (every rank of a gloo world)."""
from __future__ import annotations


def planner_beside_a_dead_weak_proxy(argv):
    """bench.plan.measure (train.py's path with the live-bytes tracker, then the planner's trace of a
    tiny copy, which tracks again) with a dead ``weakref.proxy`` alive in the process, as a CUDA
    process had one among ``gc.get_objects()``."""
    import gc
    import weakref

    from bench.plan import measure

    class Gone:
        pass

    target = Gone()
    proxy = weakref.proxy(target)
    del target
    try:
        seen = any(o is proxy for o in gc.get_objects())  # the walk meets it
        r = measure(argv)
        return dict(proxy_seen=seen, measured=sum(r["measured"].values()), predicted=r["predicted"]["peak_bytes"])
    finally:
        del proxy
