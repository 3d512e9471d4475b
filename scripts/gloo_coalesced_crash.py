"""torch alone (no megatron-core): Megatron-FSDP's gloo pattern, repeated until a process dies.

    .venv/bin/python scripts/gloo_coalesced_crash.py [--worlds 2] [--iterations 30000] [--budget-s 900]
                                                      [--one-by-one] [--no-resize] [--json [PATH]]
    .venv/bin/python scripts/gloo_coalesced_crash.py --smoke --one-by-one --json   # one world, 20 iterations

Each world is two gloo processes that, every iteration, do what Megatron-FSDP's all-gather pipeline
does with its parameter buckets (megatron_fsdp/param_and_grad_buffer.py): a coalesced asynchronous
all-gather (torch's ``_coalescing_manager(async_ops=True)``) of one or two buckets into flat tensors,
the next bucket prefetched, every gather waited for before its bucket's storage is freed by
``resize_(0)`` (``_free_storage``) and given back by a resize before the next gather
(``_alloc_storage``), a backward pass the same way in reverse, and a loss all-reduce. Nothing touches
a bucket while its gather is in flight.

On torch 2.13's gloo this dies now and then (glibc: "malloc(): unaligned tcache chunk detected",
SIGABRT; or SIGSEGV): a write into freed memory. ``--one-by-one`` issues the same all-gathers one by
one (``megatron_ext.platform.cpu_shims.gloo.all_gathers_one_by_one``, the CPU shim this project applies);
``--no-resize`` keeps the buckets' storage. Worlds run ``--worlds`` at a time until ``--iterations``
each or ``--budget-s``; the table counts worlds, iterations done and worlds that died by a signal.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench import fixed_width  # noqa: E402

SIZES = [4096, 256, 65664, 65664, 64, 130000]  # elements per bucket: large and small (tcache-sized) ones


def _rank(rank: int, port: int, iterations: int, one_by_one: bool, resize: bool, progress) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    manager = c10d._coalescing_manager
    if one_by_one:
        from megatron_ext.platform.cpu_shims.gloo import all_gathers_one_by_one

        manager = all_gathers_one_by_one(manager)
    shards = [torch.randn(n // 2) for n in SIZES]
    buckets = [torch.empty(n) for n in SIZES]
    pending: dict = {}

    def free(t):
        if resize:
            t.untyped_storage().resize_(0)

    def alloc(t):
        if t.untyped_storage().nbytes() == 0:
            t.untyped_storage().resize_(t.numel() * t.element_size())

    def gather(ids):
        with manager(group, async_ops=True) as cm:
            for i in ids:
                alloc(buckets[i])
                dist.all_gather_into_tensor(buckets[i], shards[i], group=group, async_op=True)
        for i in ids:
            pending[i] = cm

    def wait(i):
        cm = pending.pop(i, None)
        if cm is not None:
            cm.wait()

    def release(i):
        wait(i)
        free(buckets[i])

    for b in buckets:
        free(b)
    last = len(SIZES) - 1
    for it in range(iterations):
        gather([0, 1])
        for i in range(len(SIZES)):  # forward: use each bucket, prefetch the next, release
            if i < last and i + 1 not in pending:
                gather([i + 1])
            wait(i)
            buckets[i].sum()
            if i:
                release(i)
        for i in reversed(range(len(SIZES))):  # backward, in reverse
            if i not in pending and buckets[i].untyped_storage().nbytes() == 0:
                gather([i])
            if i and i - 1 not in pending:
                gather([i - 1])
            wait(i)
            (buckets[i] * 0.5).sum()
            release(i)
        loss = torch.ones(1)
        dist.all_reduce(loss, group=group)
        if rank == 0 and it % 500 == 0:
            progress.value = it
    dist.barrier()
    if rank == 0:
        progress.value = iterations
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, default=2, help="worlds at once (default 2)")
    parser.add_argument("--runs", type=int, default=4, help="worlds in all (default 4)")
    parser.add_argument("--iterations", type=int, default=30000)
    parser.add_argument("--budget-s", type=float, default=900.0)
    parser.add_argument("--one-by-one", action="store_true", help="the CPU shim: all-gathers issued one by one")
    parser.add_argument("--no-resize", action="store_true", help="keep the buckets' storage (no free / re-allocate)")
    parser.add_argument("--json", nargs="?", const="-", default=None)
    parser.add_argument("--smoke", action="store_true", help="seconds: one world of 20 iterations (the suite's run, "
                        "with --one-by-one: the crash is too rare to show in 20)")
    opts = parser.parse_args(argv)
    if opts.smoke:
        opts.worlds, opts.runs, opts.iterations, opts.budget_s = 1, 1, 20, 120.0
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    t0 = time.time()
    started = 0
    running: list = []
    rows = []
    while started < opts.runs or running:
        while started < opts.runs and len(running) < opts.worlds and time.time() - t0 < opts.budget_s:
            port, progress = _port(), ctx.Value("l", 0)
            procs = [ctx.Process(target=_rank, args=(r, port, opts.iterations, opts.one_by_one, not opts.no_resize,
                                                     progress)) for r in range(2)]
            for p in procs:
                p.start()
            running.append((procs, progress, time.time()))
            started += 1
        time.sleep(1.0)
        over = time.time() - t0 > opts.budget_s
        for world in list(running):
            procs, progress, began = world
            codes = [p.exitcode for p in procs]
            if any(c is not None and c != 0 for c in codes) or all(c == 0 for c in codes) or over:
                for p in procs:
                    if p.exitcode is None:
                        p.kill()
                    p.join()
                codes = [p.exitcode for p in procs]
                signals = sorted({-c for c in codes if c is not None and c < 0 and c != -9})
                rows.append(dict(iterations=progress.value, seconds=round(time.time() - began, 1),
                                 died=any(c not in (0, -9) for c in codes), signals=signals,
                                 finished=all(c == 0 for c in codes)))
                running.remove(world)
        if over and not running:
            break
    summary = dict(one_by_one=opts.one_by_one, resize=not opts.no_resize, worlds=len(rows),
                   iterations=sum(r["iterations"] for r in rows), died=sum(r["died"] for r in rows),
                   seconds=round(time.time() - t0, 1), runs=rows)
    cols = [("worlds", 6), ("iterations", 10), ("died", 4), ("seconds", 7)]
    for line in fixed_width(cols, [[summary[k] for k, _ in cols]]):
        print(line, file=sys.stderr)
    print(f"one-by-one={opts.one_by_one} resize={not opts.no_resize}", file=sys.stderr)
    if opts.json is not None:
        text = json.dumps(summary, indent=1)
        if opts.json == "-":
            print(text)
        else:
            with open(opts.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
