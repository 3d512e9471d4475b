"""CPU-only compatibility shims for megatron-core 0.19.2: the one place they live.

Applied by :func:`megatron_ext.platform.setup` only when CUDA is absent; never on a GPU machine.
Each :class:`Shim` names the upstream call sites it covers (file:line in the installed wheel) and is
reversible (the record type of megatron_ext/patching.py, shared with the seams), so
``tests/platform/test_cpu_shims.py`` can remove one at a time and prove it is needed.
The installed package is never edited.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import types
from typing import Dict

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from megatron_ext.patching import Patch as Shim
from megatron_ext.patching import set_attr as _patch
from megatron_ext.patching import undo_all as _undo_all
from megatron_ext.platform import streams


# --------------------------------------------------------------------------------------------
# 1. triton: megatron/core/transformer/moe/ops/paged_stash.py:4 imports triton unguarded, and
#    gpt_model.py:32 / schedules.py:27 / experts.py:43 reach it through moe/paged_stash.py:12.
#    A fake top-level `triton` breaks torch._inductor, so stand in for that one module only.
# --------------------------------------------------------------------------------------------
_PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _install_triton_free_paged_stash():
    if _PAGED_STASH_OPS in sys.modules:
        return lambda: None
    module = types.ModuleType(_PAGED_STASH_OPS)
    module.__doc__ = "CPU stand-in: the Triton paged-stash kernels exist only on CUDA."
    module.GLOBAL_BLOCK_SIZE = 1024

    def _no_kernel(*_a, **_k):
        raise RuntimeError("paged stash Triton kernels need CUDA (megatron-core moe/ops/paged_stash.py)")

    module.paged_stash_copy_kernel = _no_kernel
    module.paged_stash_pop_kernel = _no_kernel
    sys.modules[_PAGED_STASH_OPS] = module

    def undo():
        if sys.modules.get(_PAGED_STASH_OPS) is module:
            del sys.modules[_PAGED_STASH_OPS]

    return undo


# --------------------------------------------------------------------------------------------
# 2. RNG: megatron/core/tensor_parallel/random.py:118 (_get_cuda_rng_state), :165-174
#    (_set_cuda_rng_state), :303-306 (CudaRNGStatesTracker.add), :490 (model_parallel_cuda_manual_seed)
#    use the CUDA generator. On CPU the "CUDA" generator is the CPU default generator, so the
#    tracker's fork/restore keeps its meaning (per-TP-rank dropout streams). Its check that the
#    CPU state is unchanged inside a fork (random.py:332) then always fires: filtered, as it is
#    by construction here.
# --------------------------------------------------------------------------------------------
class _DropForkWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _install_cpu_rng():
    from megatron.core.tensor_parallel import random as mrandom

    log, fork_warning = logging.getLogger(mrandom.__name__), _DropForkWarning()
    log.addFilter(fork_warning)

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return _undo_all(
        [
            _patch(mrandom, "_get_cuda_rng_state", get_state),
            _patch(mrandom, "_set_cuda_rng_state", set_state),
            _patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed)),
            _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
            _patch(torch.cuda, "set_rng_state", lambda s, device="cuda": torch.set_rng_state(s)),
            lambda: log.removeFilter(fork_warning),
        ]
    )


# --------------------------------------------------------------------------------------------
# 3. Hard-coded CUDA devices and CUDA-only tensor methods, rewritten by one TorchFunctionMode.
# --------------------------------------------------------------------------------------------
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuRedirectMode(TorchFunctionMode):
    """Rewrites what megatron-core asks of CUDA into its CPU meaning. Rules are switched on by
    the shims below; with no rule on, the mode passes every call through untouched."""

    rules: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rules = self.rules
        if "device" in rules:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.device and args and _is_cuda_device(args[0]):  # `with torch.device(cuda)`
                return torch.device("cpu")
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu") + tuple(args[2:])
        if "cuda_only_methods" in rules:
            if func is torch.Tensor.record_stream:
                return None
            if func is torch.Tensor.pin_memory:
                return args[0]
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        if "tensor_type_names" in rules and func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.autograd.backward or func is torch.Tensor.backward:
            # The mode is suspended inside its own handler, but the Python backward functions of
            # megatron's autograd Functions must see it: run the engine directly, mode on.
            with self:
                return _run_backward(func, *args, **kwargs)
        return func(*args, **kwargs)


def _run_backward(func, *args, **kwargs):
    """torch.autograd.backward / Tensor.backward without re-dispatching to the mode (which would
    recurse): the same argument handling, then the autograd engine itself."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    if func is torch.Tensor.backward:
        bound = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "inputs"), args))
        bound.update({"grad_tensors" if k == "gradient" else k: v for k, v in kwargs.items()})
    else:
        bound = dict(zip(("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"), args))
        bound.update(kwargs)
    tensors = (bound["tensors"],) if torch.is_tensor(bound["tensors"]) else tuple(bound["tensors"])
    grads = _tensor_or_tensors_to_tuple(bound.get("grad_tensors"), len(tensors))
    grads = _make_grads(tensors, grads, is_grads_batched=False)
    create_graph = bool(bound.get("create_graph"))
    retain_graph = create_graph if bound.get("retain_graph") is None else bound["retain_graph"]
    inputs = bound.get("inputs")
    inputs = () if inputs is None else ((inputs,) if torch.is_tensor(inputs) else tuple(inputs))
    _engine_run_backward(tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


_MODE: _CpuRedirectMode | None = None


def _mode_rule(rule: str):
    def install():
        global _MODE
        if _MODE is None:
            _MODE = _CpuRedirectMode()
            _MODE.__enter__()
        _CpuRedirectMode.rules = _CpuRedirectMode.rules | {rule}

        def undo():
            _CpuRedirectMode.rules = _CpuRedirectMode.rules - {rule}

        return undo

    return install


# --------------------------------------------------------------------------------------------
# 4. CUDA runtime calls with no CPU meaning: streams, events, synchronize, current_device.
# --------------------------------------------------------------------------------------------
# The one CPU stream/event stand-in is streams.CpuStream / CpuEvent (in the faithful mode side-stream
# work runs later on a worker, at a modelled link bandwidth); megatron-core's torch.cuda.Stream / Event
# become it, and torch.cuda.synchronize waits for every CPU stream.
_DEFAULT_STREAM = streams.host_stream()


def _install_cuda_runtime_stand_ins():
    c = torch.cuda
    return _undo_all(
        [
            _patch(c, "current_device", lambda: 0),
            _patch(c, "set_device", lambda _d: None),
            _patch(c, "synchronize", lambda _d=None: streams.synchronize_all()),
            _patch(c, "Stream", streams.CpuStream),
            _patch(c, "Event", streams.CpuEvent),
            _patch(c, "current_stream", lambda _d=None: _DEFAULT_STREAM),
            _patch(c, "default_stream", lambda _d=None: _DEFAULT_STREAM),
            _patch(c, "stream", lambda _s=None: contextlib.nullcontext()),
            _patch(c, "empty_cache", lambda: None),
            _patch(c, "memory_allocated", lambda _d=None: 0),
            _patch(c, "max_memory_allocated", lambda _d=None: 0),
            _patch(c, "memory_reserved", lambda _d=None: 0),
            _patch(c, "max_memory_reserved", lambda _d=None: 0),
            _patch(c, "reset_peak_memory_stats", lambda _d=None: None),
        ]
    )


# --------------------------------------------------------------------------------------------
# 6. megatron/core/transformer/moe/moe_utils.py:1184 (maybe_move_tensor_to_cpu) turns the alltoall
#    split sizes into host numpy arrays only for CUDA tensors (token_dispatcher.py:927-943); on CPU
#    they stay tensors, which megatron's all_to_all (mappings.py) and gloo cannot use as sizes.
# --------------------------------------------------------------------------------------------
def _install_host_split_sizes():
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
# 7. megatron/core/tensor_parallel/mappings.py:154 (all_gather into uneven splits) and :197
#    (reduce_scatter of uneven splits): NCCL accepts uneven sizes, gloo does not. Pad every
#    piece to the largest, run the even collective, slice back.
# --------------------------------------------------------------------------------------------
def _install_uneven_collectives():
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
# 8. megatron/core/transformer/torch_norm.py:50 asserts `not config.sequence_parallel` when
#    neither apex nor TE exists, which blocks TP+SP and TP+MoE on the local spec. torch's norm is
#    correct under SP if its weights are marked `sequence_parallel`, so DDP/finalize_model_grads
#    all-reduce their grads over the TP group (megatron/core/distributed/finalize_model_grads.py).
# --------------------------------------------------------------------------------------------
def _install_torch_norm_sequence_parallel():
    # Up a floor, on purpose: the patch is needed on CUDA too, so the record is a seam
    # (megatron_ext/seams/training.py, which training/model.py applies on CUDA); on CPU it is always
    # on, like every shim here. One record for both: removing the shim removes the seam.
    from megatron_ext.seams.training import TORCH_NORM_SEQUENCE_PARALLEL as seam

    seam.apply()
    return seam.remove


# --------------------------------------------------------------------------------------------
# 9. megatron/core/jit.py:21 makes `jit_fuser = torch.compile` (bias_swiglu, bias_gelu, rotary, MoE
#    permute helpers, ...). On CPU each process then spends ~18 s compiling for a tiny model. Run
#    those functions eagerly instead: the same math, without the compile. dynamo's `disable` is a
#    per-thread override (a context variable), unset on the autograd device thread where a
#    recomputed router or activation runs in the backward; the force_eager stance covers every thread.
# --------------------------------------------------------------------------------------------
def _install_eager_jit_fuser():
    import torch._dynamo
    from torch._dynamo import eval_frame

    undo = _patch(torch._dynamo.config, "disable", True)
    before = eval_frame._stance
    torch.compiler.set_stance("force_eager")

    def remove():
        torch.compiler.set_stance(before.stance, skip_guard_eval_unsafe=before.skip_guard_eval_unsafe,
                                  force_backend=before.backend)
        undo()

    return remove


# --------------------------------------------------------------------------------------------
# 10. megatron/training/arguments.py:1414 (validate_args, TP or CP > 1) asks for the GPU's compute
#     capability via get_device_arch_version (megatron/training/utils/common_utils.py:504). A CPU
#     has none: report 0 (pre-Blackwell), whose branch then asserts CUDA_DEVICE_MAX_CONNECTIONS=1
#     (arguments.py:1437), a CUDA launch setting with no CPU meaning: set it.
# --------------------------------------------------------------------------------------------
def _install_no_device_arch():
    import os

    from megatron.training import arguments

    old_env = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    undo_arch = _patch(arguments, "get_device_arch_version", lambda: 0)

    def undo():
        undo_arch()
        if old_env is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = old_env

    return undo


# --------------------------------------------------------------------------------------------
# 13. Megatron-FSDP divides the gradients inside the reduce-scatter with NCCL's PREMUL_SUM
#     (megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4746-4748,
#     gradient_reduce_div_fusion, on by default); gloo has no PREMUL_SUM. PREMUL_SUM multiplies
#     each rank's input by the factor before summing, which is the branch it falls back to for bf16
#     (:4751-4752): scale in place, then SUM. Same products, same sum order.
# --------------------------------------------------------------------------------------------
def _install_fsdp_premul_sum_as_scale():
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
# 14. torch/distributed/distributed_c10d.py:2837 (_coalescing_manager), as imported by
#     megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:33 (Megatron-FSDP's
#     parameter all-gathers, :4561) and megatron/core/distributed/param_and_grad_buffer.py:15 (the
#     distributed optimizer's overlapped parameter gather). On gloo, torch's coalesced all-gather
#     (ProcessGroupGloo::allgather_into_tensor_coalesced, one flat gather copied back into every
#     output) corrupts the heap when its output storages are later freed and re-allocated by
#     resizing (Megatron-FSDP's _free_storage / _alloc_storage): glibc's "malloc(): unaligned tcache
#     chunk detected" or a segfault, now and then, even with every wait() done before the resize
#     (scripts/gloo_coalesced_crash.py reproduces it with torch alone; docs/reliability.md). The
#     same all-gathers issued one by one at the block's end, each an ordinary async all_gather_single
#     whose work the manager waits for, are what NCCL's coalescing launches anyway (one kernel per
#     tensor in a group): the same collectives, the same order, the same waits. Every other kind of
#     coalesced op still goes through torch's manager.
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


def _install_gloo_all_gathers_one_by_one():
    import megatron.core.distributed.param_and_grad_buffer as ddp_buffers
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffers
    from torch.distributed import distributed_c10d as c10d

    original = c10d._coalescing_manager
    safe = all_gathers_one_by_one(original)
    return _undo_all([_patch(module, "_coalescing_manager", safe) for module in (c10d, dist, ddp_buffers, fsdp_buffers)])


SHIMS: Dict[str, Shim] = {
    s.name: s
    for s in [
        Shim(
            "triton_free_paged_stash",
            ["megatron/core/transformer/moe/ops/paged_stash.py:4"],
            "unguarded `import triton` reached by importing GPTModel and the schedules",
            _install_triton_free_paged_stash,
        ),
        Shim(
            "cpu_rng",
            [
                "megatron/core/tensor_parallel/random.py:118",
                "megatron/core/tensor_parallel/random.py:165",
                "megatron/core/tensor_parallel/random.py:305",
                "megatron/core/tensor_parallel/random.py:490",
            ],
            "the model-parallel RNG tracker reads and writes the CUDA generator",
            _install_cpu_rng,
        ),
        Shim(
            "cuda_device_to_cpu",
            [
                "megatron/core/utils.py:712",
                "megatron/core/transformer/utils.py:39",
                "megatron/core/pipeline_parallel/schedules.py:749",
                "megatron/core/pipeline_parallel/p2p_communication.py:339",
                "megatron/core/distributed/param_and_grad_buffer.py:1183",
                "megatron/core/optimizer/clip_grads.py:108",
                "megatron/core/optimizer/optimizer.py:315",
                "megatron/core/tensor_parallel/mappings.py:145",
                "megatron/core/transformer/moe/router.py:98",
                "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py:78",
                "megatron/core/models/common/embeddings/yarn_rotary_pos_embedding.py:122",
            ],
            "device='cuda' / torch.cuda.current_device() hard-coded in factory calls and .to()",
            _mode_rule("device"),
        ),
        Shim(
            "cuda_only_tensor_methods",
            [
                "megatron/core/pipeline_parallel/utils.py:269",
                "megatron/core/models/gpt/fine_grained_callables.py:243",
            ],
            "Tensor.record_stream / pin_memory have no CPU meaning",
            _mode_rule("cuda_only_methods"),
        ),
        Shim(
            "cuda_tensor_type_names",
            [
                "megatron/core/optimizer/clip_grads.py:174",
                "megatron/core/optimizer/distrib_optimizer.py:401",
                "megatron/core/optimizer/distrib_optimizer.py:466",
                "megatron/core/optimizer/distrib_optimizer.py:758",
                "megatron/core/optimizer/optimizer.py:1009",
            ],
            "params are accepted only if Tensor.type() == 'torch.cuda.FloatTensor' (or Half/BFloat16)",
            _mode_rule("tensor_type_names"),
        ),
        Shim(
            "cuda_runtime_stand_ins",
            [
                "megatron/core/distributed/param_and_grad_buffer.py:632",
                "megatron/core/pipeline_parallel/p2p_communication.py:419",
                "megatron/core/transformer/moe/token_dispatcher.py:469",
                "megatron/core/transformer/moe/token_dispatcher.py:922",
                "megatron/core/pipeline_parallel/utils.py:392",
            ],
            "streams, events, synchronize and current_device are CUDA runtime calls",
            _install_cuda_runtime_stand_ins,
        ),
        Shim(
            "host_split_sizes",
            ["megatron/core/transformer/moe/moe_utils.py:1184", "megatron/core/transformer/moe/token_dispatcher.py:927"],
            "alltoall split sizes stay tensors on CPU; megatron's all_to_all and gloo want host sizes",
            _install_host_split_sizes,
        ),
        Shim(
            "uneven_collectives",
            ["megatron/core/tensor_parallel/mappings.py:154", "megatron/core/tensor_parallel/mappings.py:197"],
            "gloo rejects uneven all_gather / reduce_scatter (TP x EP with the alltoall dispatcher)",
            _install_uneven_collectives,
        ),
        Shim(
            "torch_norm_sequence_parallel",
            ["megatron/core/transformer/torch_norm.py:50"],
            "torch LayerNorm refused under sequence parallel without apex/TE (blocks TP+MoE)",
            _install_torch_norm_sequence_parallel,
        ),
        Shim(
            "eager_jit_fuser",
            ["megatron/core/jit.py:21"],
            "jit_fuser = torch.compile costs ~18 s of compilation per process on CPU",
            _install_eager_jit_fuser,
        ),
        Shim(
            "no_device_arch",
            [
                "megatron/training/arguments.py:1414",
                "megatron/training/arguments.py:1437",
                "megatron/training/utils/common_utils.py:504",
            ],
            "validate_args reads the GPU compute capability when TP or CP > 1",
            _install_no_device_arch,
        ),
        Shim(
            "gloo_all_gathers_one_by_one",
            ["torch/distributed/distributed_c10d.py:2837",
             "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4561",
             "megatron/core/distributed/param_and_grad_buffer.py:15"],
            "gloo's coalesced all-gather corrupts the heap once its outputs' storages are resized "
            "(Megatron-FSDP's buckets): the block's all-gathers are issued one by one",
            _install_gloo_all_gathers_one_by_one,
        ),
        Shim(
            "fsdp_premul_sum_as_scale",
            ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4748"],
            "Megatron-FSDP reduce-scatters gradients with NCCL's PREMUL_SUM, which gloo lacks",
            _install_fsdp_premul_sum_as_scale,
        ),
    ]
}


# --------------------------------------------------------------------------------------------
# 11./12. The CUDA-faithful CPU mode (megatron_ext/platform/faithful.py): installed with the other
#     shims, active only while the mode is on. The backward on the autograd device thread
#     (autograd_thread.py) and NCCL's point-to-point rules (nccl_p2p.py).
# --------------------------------------------------------------------------------------------
def _register_faithful_mode() -> None:
    from megatron_ext.platform import autograd_thread, nccl_p2p

    for shim in (
        Shim(
            "faithful_autograd_device_thread",
            [
                "megatron/core/pipeline_parallel/schedules.py:220",
                "megatron/core/pipeline_parallel/schedules.py:574",
                "megatron/core/tensor_parallel/random.py:656",
            ],
            "on CUDA every backward (and the recompute inside it) runs on the autograd engine's "
            "device thread, not the caller's; CPU autograd runs it on the caller's",
            autograd_thread.install,
        ),
        Shim(
            "faithful_nccl_p2p",
            [
                "megatron/core/pipeline_parallel/p2p_communication.py:79",
                "megatron/core/pipeline_parallel/p2p_communication.py:48",
            ],
            "NCCL runs a communicator's sends/recvs in issue order and a send completes only with "
            "the peer's recv; gloo matches each (source, tag) on its own",
            nccl_p2p.install,
        ),
    ):
        SHIMS[shim.name] = shim


_register_faithful_mode()


def apply_all() -> None:
    for shim in SHIMS.values():
        shim.apply()


def without(name: str):
    """Temporarily remove one shim (tests prove each one is needed)."""
    return SHIMS[name].without()
