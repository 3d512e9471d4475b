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


def storage_at_a_dead_ones_address():
    """A storage freed and one of its size allocated next, until one lands at the freed address (glibc
    hands a freed block back); then another storage. The tracker's live bytes and peak, and the truth."""
    import torch

    from megatron_ext.measure.memtrack import LiveBytesTracker

    # which size glibc hands back at once depends on the heap a worker's earlier jobs left: try many
    for numel in (16384, 4096, 256, 65536, 1024, 8192, 512, 2048, 32768, 128, 262144, 24576):
        with LiveBytesTracker() as tracker:
            for _ in range(50):
                x = torch.ones(numel)
                address = x.data_ptr()
                del x
                y = torch.ones(numel)
                if y.data_ptr() == address:
                    z = torch.ones(512)
                    expected = 4 * numel + 4 * 512
                    live = tracker.sample()
                    break
                del y
            else:
                continue
        del y, z
        return dict(reused=True, live=live, peak=tracker.peak, expected=expected)
    return dict(reused=False)
