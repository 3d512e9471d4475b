"""Distributed probe of the Megatron-FSDP CPU shim: the gradient reduce-scatter's reduction op."""
from __future__ import annotations

import contextlib

import torch


def premul_reduce_scatter(without_shim: bool):
    """param_and_grad_buffer.py:4748 — the reduction op Megatron-FSDP hands its gradient
    reduce-scatter for an fp32 buffer with a scaling factor (gradient averaging), run on gloo."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )

    from megatron_ext.platform import cpu_shims

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    grad = torch.arange(4 * world, dtype=torch.float32) + 10 * rank
    out = torch.empty(4)
    config = DistributedDataParallelConfig()  # gradient_reduce_div_fusion on, as megatron's default
    with cpu_shims.without("fsdp_premul_sum_as_scale") if without_shim else contextlib.nullcontext():
        try:
            op = buffers.gradient_reduce_preprocessing(grad, 1.0 / world, config)
            torch.distributed.reduce_scatter_tensor(out, grad, op=op)
        except Exception as e:  # noqa: BLE001 - the probe reports what gloo said
            return f"error: {type(e).__name__}: {e}"
    return out.tolist()


def coalesced_all_gathers(without_shim: bool) -> dict:
    """param_and_grad_buffer.py:4561 — Megatron-FSDP's coalesced parameter all-gathers (async, two
    buckets, waited through the manager) and a coalesced reduce-scatter, through the manager its
    module imported: which ProcessGroup calls reach gloo, and the results."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    from megatron_ext.platform import cpu_shims

    rank = torch.distributed.get_rank()
    calls = []
    group_class = torch.distributed.ProcessGroup
    names = ("all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single_coalesced")
    # the class's own descriptors (getattr would give pybind's unbound functions, which do not bind)
    originals = {n: group_class.__dict__[n] for n in names}

    def counting(name):
        def call(self, *args, **kwargs):
            calls.append(name)
            return originals[name].__get__(self, group_class)(*args, **kwargs)
        return call

    outs = [torch.empty(8), torch.empty(2)]
    shard = torch.empty(4)
    with cpu_shims.without("gloo_all_gathers_one_by_one") if without_shim else contextlib.nullcontext():
        for n in names:
            setattr(group_class, n, counting(n))
        try:
            with buffers._coalescing_manager(torch.distributed.group.WORLD, async_ops=True) as cm:
                torch.distributed.all_gather_into_tensor(outs[0], torch.full((4,), rank + 1.0), async_op=True)
                torch.distributed.all_gather_into_tensor(outs[1], torch.full((1,), rank + 3.0), async_op=True)
            cm.wait()
            with buffers._coalescing_manager(torch.distributed.group.WORLD):
                torch.distributed.reduce_scatter_tensor(shard, torch.arange(8.0) + rank)
        finally:
            for n, fn in originals.items():
                setattr(group_class, n, fn)
    return dict(calls=calls, outs=[o.tolist() for o in outs], shard=shard.tolist(), waits=len(cm.works))
