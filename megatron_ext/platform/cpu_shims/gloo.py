"""CPU shims for what megatron-core asks of NCCL that gloo does not do: host split sizes for its
all-to-all, uneven all-gathers and reduce-scatters, PREMUL_SUM, and a coalesced all-gather that stays
sound once its outputs' storages are resized. Each install returns its own undo (cpu_shims/__init__.py:
the records)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_ext.patching import set_attr as _patch
from megatron_ext.patching import undo_all as _undo_all


# --------------------------------------------------------------------------------------------
# megatron/core/transformer/moe/moe_utils.py:1184 (maybe_move_tensor_to_cpu) turns the alltoall
# split sizes into host numpy arrays only for CUDA tensors (token_dispatcher.py:927-943); on CPU
# they stay tensors, which megatron's all_to_all (mappings.py) and gloo cannot use as sizes.
# --------------------------------------------------------------------------------------------
def install_host_split_sizes():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return _undo_all(
        [
            _patch(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu),
            _patch(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu),
        ]
    )


# --------------------------------------------------------------------------------------------
# megatron/core/tensor_parallel/mappings.py:154 (all_gather into uneven splits) and :197
# (reduce_scatter of uneven splits): NCCL accepts uneven sizes, gloo does not. Pad every
# piece to the largest, run the even collective, slice back.
# --------------------------------------------------------------------------------------------
def install_uneven_collectives():
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def uneven_all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) <= 1 or async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        pad = max(sizes)
        padded_in = tensor.new_zeros((pad,) + tuple(tensor.shape[1:]))
        padded_in[: tensor.shape[0]] = tensor
        padded_out = [tensor.new_empty(padded_in.shape) for _ in sizes]
        all_gather(padded_out, padded_in, group=group)
        for out, got, n in zip(tensor_list, padded_out, sizes):
            out.copy_(got[:n])

    def uneven_reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        sizes = [t.shape[0] for t in input_list]
        if len(set(sizes)) <= 1 or async_op:
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        out, padded = pad_reduce_scatter_pieces(output, input_list)
        reduce_scatter(out, padded, op=op, group=group)
        output.copy_(out[: output.shape[0]])

    return _undo_all(
        [
            _patch(dist, "all_gather", uneven_all_gather),
            _patch(dist, "reduce_scatter", uneven_reduce_scatter),
        ]
    )


def pad_reduce_scatter_pieces(output, input_list):
    """gloo reduce-scatters equal pieces only: each piece zero-padded to the largest, and an output
    of that size (the caller copies its first output.shape[0] rows back). Padding rows reduce to
    zeros and are dropped, so the kept rows are bit-identical."""
    pad = max(t.shape[0] for t in input_list)
    padded = []
    for t in input_list:
        p = t.new_zeros((pad,) + tuple(t.shape[1:]))
        p[: t.shape[0]] = t
        padded.append(p)
    return output.new_empty((pad,) + tuple(output.shape[1:])), padded


# --------------------------------------------------------------------------------------------
# Megatron-FSDP divides the gradients inside the reduce-scatter with NCCL's PREMUL_SUM
# (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4746-4748,
# gradient_reduce_div_fusion, on by default); gloo has no PREMUL_SUM. PREMUL_SUM multiplies
# each rank's input by the factor before summing, which is the branch it falls back to for bf16
# (:4751-4752): scale in place, then SUM. Same products, same sum order.
# --------------------------------------------------------------------------------------------
def install_fsdp_premul_sum_as_scale():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    original = buffers.gradient_reduce_preprocessing

    @torch.no_grad()
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if (scaling_factor is not None and not ddp_config.average_in_collective
                and ddp_config.gradient_reduce_div_fusion and grad_data.dtype != torch.bfloat16):
            grad_data.mul_(scaling_factor)
            return dist.ReduceOp.SUM
        return original(grad_data, scaling_factor, ddp_config)

    return _patch(buffers, "gradient_reduce_preprocessing", gradient_reduce_preprocessing)


# --------------------------------------------------------------------------------------------
# torch/distributed/distributed_c10d.py:2837 (_coalescing_manager), as imported by
# megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:33 (Megatron-FSDP's
# parameter all-gathers, :4561) and megatron/core/distributed/param_and_grad_buffer.py:15 (the
# distributed optimizer's overlapped parameter gather). On gloo, torch's coalesced all-gather
# (ProcessGroupGloo::allgather_into_tensor_coalesced, one flat gather copied back into every
# output) corrupts the heap when its output storages are later freed and re-allocated by
# resizing (Megatron-FSDP's _free_storage / _alloc_storage): glibc's "malloc(): unaligned tcache
# chunk detected" or a segfault, now and then, even with every wait() done before the resize
# (scripts/gloo_coalesced_crash.py reproduces it with torch alone; docs/reliability.md). The
# same all-gathers issued one by one at the block's end, each an ordinary async all_gather_single
# whose work the manager waits for, are what NCCL's coalescing launches anyway (one kernel per
# tensor in a group): the same collectives, the same order, the same waits. Every other kind of
# coalesced op still goes through torch's manager.
# --------------------------------------------------------------------------------------------
def all_gathers_one_by_one(torch_manager):
    """A ``_coalescing_manager`` that issues the block's all-gathers individually on the group."""
    from torch.distributed import distributed_c10d as c10d

    @contextlib.contextmanager
    def manager(group=None, device=None, async_ops=False):
        group = group or c10d._get_default_group()
        if device is not None:  # the backend's own start/end coalescing: torch's path
            with torch_manager(group, device, async_ops) as cm:
                yield cm
            return
        state = c10d._world.pg_coalesce_state
        if state.get(group):
            raise ValueError("ProcessGroup has non-empty op list at the start of coalescing")
        state[group] = []
        cm = c10d._CoalescingManager()
        try:
            yield cm
        finally:
            ops = state.pop(group, [])
        if ops and all(op.op is c10d.all_gather_single for op in ops):
            opts = c10d.AllgatherOptions()
            opts.asyncOp = async_ops
            works = [group.all_gather_single(op.dst_tensor, op.tensor, opts) for op in ops]
            for work in works:
                if async_ops:
                    cm.append(work)
                else:
                    work.wait()
            return
        with torch_manager(group, None, async_ops) as inner:  # the recorded ops, issued by torch
            state[group].extend(ops)
        cm.works.extend(inner.works)

    manager.__wrapped__ = torch_manager
    return manager


def install_gloo_all_gathers_one_by_one():
    import megatron.core.distributed.param_and_grad_buffer as ddp_buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers
    from torch.distributed import distributed_c10d as c10d

    original = c10d._coalescing_manager
    safe = all_gathers_one_by_one(original)
    return _undo_all([_patch(module, "_coalescing_manager", safe) for module in (c10d, dist, ddp_buffers, fsdp_buffers)])
