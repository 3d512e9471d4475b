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
