"""cuda_facts: what the CPU platform simulates, checked on the device."""
from __future__ import annotations

import threading

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda


def section_cuda_facts(size, claims) -> dict:
    """The CUDA behaviour the CPU platform's faithful mode imitates, observed on this device."""
    from megatron_ext.moe.sync_detector import run_backward
    from megatron_ext.platform import faithful, streams

    local = threading.local()
    local.lane = "caller"
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen["thread"] = threading.get_ident()
            seen["local"] = getattr(local, "lane", None)
            return g * 2

    dev = "cuda" if cuda() else "cpu"
    x = torch.randn(1024, device=dev, requires_grad=True)
    run_backward(Probe.apply(x).sum())
    observed_thread = {
        "backward_on_other_thread": seen["thread"] != threading.get_ident(),
        "threading_local_seen_in_backward": seen["local"] == "caller",
    }

    n = size["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = streams.host_empty(n)
    side = streams.Stream()
    side.wait(streams.Stream.current())
    side.run(lambda: dst.copy_(src, non_blocking=True))
    event = side.record()
    done_at_enqueue = event.query()
    event.synchronize()
    observed_event = {"copy_bytes": n, "event_done_right_after_enqueue": done_at_enqueue,
                      "event_done_after_synchronize": event.query()}

    out = {"faithful_mode": faithful.enabled()}
    if cuda():
        p = torch.cuda.get_device_properties(0)
        out.update(status="ok", device=p.name, compute_capability=f"{p.major}.{p.minor}", memory_bytes=p.total_memory,
                   multiprocessors=p.multi_processor_count, **observed_thread, **observed_event)
        claim(claims, "CUDA backward nodes run on a thread other than the caller's", observed_thread["backward_on_other_thread"])
        claim(claims, "threading.local values are not carried into CUDA backward", not observed_thread["threading_local_seen_in_backward"])
        claim(claims, "an event after a D2H copy is not complete right after enqueue", not done_at_enqueue)
        claim(claims, "the event completes once synchronized", observed_event["event_done_after_synchronize"])
    else:
        out.update(status="ok", backward_on_other_thread=NO_CUDA, threading_local_seen_in_backward=NO_CUDA,
                   event_done_right_after_enqueue=NO_CUDA, event_done_after_synchronize=NO_CUDA,
                   cpu_platform_observed={**observed_thread, **observed_event})
        for text in ("CUDA backward nodes run on a thread other than the caller's",
                     "an event after a D2H copy is not complete right after enqueue"):
            claim(claims, text, NO_CUDA)
    return out
