"""Distributed probes of the CUDA-faithful mode's NCCL point-to-point rules (2 ranks)."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _setting(without_shim: bool):
    """A fresh 2-rank group, the mode on, the shim removed or not; the group is destroyed after."""
    import os

    from megatron_ext.platform import cpu_shims, faithful

    old = os.environ.get(faithful.ENV)
    os.environ[faithful.ENV] = "1"
    group = dist.new_group([0, 1])
    try:
        with cpu_shims.without("faithful_nccl_p2p") if without_shim else contextlib.nullcontext():
            yield group
    finally:
        dist.barrier()
        dist.destroy_process_group(group)
        if old is None:
            os.environ.pop(faithful.ENV, None)
        else:
            os.environ[faithful.ENV] = old


def both_send_first(without_shim: bool) -> dict:
    """Each rank sends to the other, then receives, on one group: fine on gloo (sends and receives
    of a pair are matched independently), a deadlock under NCCL's in-order rule."""
    rank = dist.get_rank()
    with _setting(without_shim) as group:
        t0 = time.perf_counter()
        try:
            send = dist.isend(torch.full((4,), float(rank)), 1 - rank, group=group, tag=3)
            got = torch.zeros(4)
            recv = dist.irecv(got, 1 - rank, group=group, tag=3)
            recv.wait()
            send.wait()
            return {"completed": True, "got": got.tolist(), "seconds": time.perf_counter() - t0}
        except RuntimeError as e:
            return {"completed": False, "error": str(e), "type": type(e).__name__,
                    "seconds": time.perf_counter() - t0}


def both_receive_first(without_shim: bool) -> dict:
    rank = dist.get_rank()
    with _setting(without_shim) as group:
        try:
            got = torch.zeros(2)
            if rank == 0:
                recv = dist.irecv(got, 1, group=group)
                dist.isend(torch.ones(2), 1, group=group).wait()
            else:
                recv = dist.irecv(got, 0, group=group)
                dist.isend(torch.ones(2), 0, group=group).wait()
            recv.wait()
            return {"completed": True}
        except RuntimeError as e:
            return {"completed": False, "error": str(e)}


def order_not_tags(without_shim: bool):
    """Rank 0 sends p (tag 1) then q (tag 2); rank 1 receives tag 2 first. NCCL ignores tags and
    matches by order: the first receive gets p. gloo matches the tags: it gets q."""
    rank = dist.get_rank()
    with _setting(without_shim) as group:
        if rank == 0:
            a = dist.isend(torch.full((2,), 1.0), 1, group=group, tag=1)
            b = dist.isend(torch.full((2,), 2.0), 1, group=group, tag=2)
            a.wait()
            b.wait()
            return None
        first, second = torch.zeros(2), torch.zeros(2)
        w2 = dist.irecv(first, 0, group=group, tag=2)
        w1 = dist.irecv(second, 0, group=group, tag=1)
        w2.wait()
        w1.wait()
        return [first.tolist(), second.tolist()]


def send_completes_with_the_receive() -> dict:
    """A send completes only once the peer's matching receive runs; grouped ops pass through."""
    rank = dist.get_rank()
    with _setting(False) as group:
        out = {}
        dist.barrier(group=group)
        if rank == 0:
            t0 = time.perf_counter()
            work = dist.isend(torch.ones(8), 1, group=group)
            out["completed_at_once"] = work.is_completed()
            work.wait()
            out["send_seconds"] = time.perf_counter() - t0
        else:
            time.sleep(0.5)
            dist.recv(torch.zeros(8), 0, group=group)
        # a grouped exchange (batch_isend_irecv) runs as one unit: no order between its ops
        got = torch.zeros(3)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), 1 - rank, group),
               dist.P2POp(dist.irecv, got, 1 - rank, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["grouped_got"] = got.tolist()
        return out
