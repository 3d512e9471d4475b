"""Seams of FP8 training on the local spec (megatron_ext/fp8/), through torchao's float8 training.

Nothing of megatron-core is replaced globally. Per instance, on the linears a run computes in FP8
(after the model is built, before the data-parallel wrapper; the instances die with the model):
  ColumnParallelLinear._forward_impl   tensor_parallel/layers.py:1094 (called at :1168)
  RowParallelLinear._forward_impl      tensor_parallel/layers.py:1424 (called at :1459)
    -> an instance attribute shadowing the class's method: the same arguments, the same choice between
       a trainable and a frozen weight (:1095), and the products of
       LinearWithGradAccumulationAndAsyncCommunication (:525: forward :576 ``x @ W.t()``, dgrad :626
       ``dy @ W``, wgrad :677 ``dy.t() @ x``) or LinearWithFrozenWeight (:404) as torchao's float8
       products (torchao/float8/float8_linear.py matmul_with_hp_or_float8_args: the casts of
       hp_tensor_to_float8_dynamic, ``torch.mm`` of two Float8TrainingTensors = ``torch._scaled_mm``).
       The communication is megatron's, in megatron's order: the sequence-parallel all-gather of the
       input in forward and again in backward (dist_all_gather_func, :557/:611), the asynchronous
       all-reduce (:633) or reduce-scatter (:644) of the input gradient while the weight gradient is
       computed, and the weight gradient accumulated into ``main_grad`` with gradient-accumulation
       fusion (:650-:705, ``grad_added_to_main_grad`` included). Tensorwise scales come from the
       whole tensor: each operand's amax is all-reduced (MAX) over the linear's tensor-parallel group
       (the expert-TP group for experts), so a sharded product uses TP1's scales.
The zero-sync grouped experts (megatron_ext/moe/grouped_experts.py) find ``float8_grouped_matmul`` on
their experts' linears (``linear.float8``) and run torchao's MoE float8 recipe
(torchao/prototype/moe_training/fp8_grouped_mm.py: rowwise scales, ``torch._scaled_grouped_mm``) over
device-side offsets; megatron's SequentialMLP runs this seam's tensorwise products on each expert's linear.
Read, never written: .tp_group, .sequence_parallel, .explicit_expert_comm (layers.py:953, :1058, :960,
  :1314, :1313, :1326), the weight's ``main_grad`` / ``grad_added_to_main_grad`` / ``zero_out_wgrad``
  (distributed/param_and_grad_buffer.py and distributed_data_parallel.py set them).
Reused unchanged: tensor_parallel.mappings gather_from_sequence_parallel_region (:522, the frozen
  path, as layers.py:517), utils.get_global_memory_buffer (the all-gather buffer, layers.py:555),
  prepare_input_tensors_for_wgrad_compute (layers.py:630).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from dataclasses import dataclass

import torch

FP8_DTYPES = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}


@contextlib.contextmanager
def _quiet_import():
    """torchao's import logs each optional CUDA extension it cannot load (a CPU build has none) and
    torch warns once about an enum it registers: neither concerns a run that uses neither."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def torchao_float8():
    """torchao.float8's modules (imported on first use: importing torchao registers its ops with torch)."""
    with _quiet_import():
        import torchao.float8.float8_training_tensor as tensor
        import torchao.float8.float8_utils as utils
        from torchao.float8 import config
    return config, tensor, utils


@dataclass(frozen=True)
class Float8Recipe:
    """What megatron's flags ask: --fp8-format (``e4m3``: every operand e4m3; ``hybrid``: the output
    gradient e5m2) with tensorwise scaling; ``wgrad``: the weight gradient in FP8 (--no-fp8-wgrad: in
    high precision, as transformer-engine's)."""

    fmt: str = "hybrid"
    wgrad: bool = True

    def torchao_config(self):
        """torchao's Float8LinearConfig of this recipe (torchao's default is ``hybrid``)."""
        config, _, _ = torchao_float8()
        fwd_dtype, grad_dtype = FP8_DTYPES[self.fmt]
        # the weight gradient in high precision: its operands not cast, each named with the dtype of its
        # other product's cast (torchao requires a tensor's casts to agree)
        disabled = lambda dtype: config.CastConfig(scaling_type=config.ScalingType.DISABLED,  # noqa: E731
                                                   target_dtype=dtype)
        hp = dict(cast_config_input_for_grad_weight=disabled(fwd_dtype),
                  cast_config_grad_output_for_grad_weight=disabled(grad_dtype))
        return config.Float8LinearConfig(cast_config_grad_output=config.CastConfig(target_dtype=grad_dtype),
                                         **({} if self.wgrad else hp))

    def mm_config(self):
        """torchao's LinearMMConfig as Float8Linear builds it from the config (float8_linear.py:238)."""
        _, tensor, _ = torchao_float8()
        c = self.torchao_config()
        gemm = lambda g: tensor.ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)  # noqa: E731
        return tensor.LinearMMConfig(gemm(c.gemm_config_output), gemm(c.gemm_config_grad_input),
                                     gemm(c.gemm_config_grad_weight))


def _amax(tensors, group) -> list:
    """max |t| of each tensor over the whole tensor: this rank's, all-reduced (MAX) over ``group``
    (one collective for all of them). float32 holds a 16-bit amax exactly."""
    amax = [_fused(_abs_max, t)(t) if t.numel() else t.new_zeros(()) for t in tensors]
    if group is None or group.size() == 1:
        return amax
    stacked = torch.stack([a.float() for a in amax])
    torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX, group=group)
    return list(stacked.unbind(0))


def _scale(amax, dtype):
    _, _, utils = torchao_float8()
    return utils.amax_to_scale(amax, dtype)


def _abs_max(t):
    return torch.max(torch.abs(t))  # torchao's tensor_to_amax


def _bits(t, scale, dtype):
    """torchao's cast to float8 (float8_training_tensor.py _ToFloat8ConstrFunc.forward): the tensor in
    float32 times the scale, saturated (float8_utils.to_fp8_saturated)."""
    limit = torch.finfo(dtype).max
    return (t.to(torch.float32) * scale).clamp(min=-limit, max=limit).to(dtype)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=True)


def _fused(fn, t):
    """``fn(t, ...)`` compiled on CUDA (one fused kernel where eager runs one per op, as torchao recommends
    its casts be run), eager elsewhere: the same bits (tests/fp8 on CPU, gpu_check's fp8 section on
    CUDA). Dynamic shapes, and ``t`` detached: a parameter or a view made dynamo guard on its class or its
    base and compile again per linear until its recompile limit, after which the casts ran eager (the
    H200 run of 2026-11-30; this form is not measured there yet)."""
    if not t.is_cuda:
        return fn
    return compiled_cast(fn)


def compiled_cast(fn):
    """``fn`` compiled once for every tensor it will see: dynamic shapes, the tensor detached (whose
    class and base dynamo would otherwise guard on)."""
    compiled = _compiled(fn)
    return lambda x, *rest: compiled(x.detach(), *rest)


def float8_bits(t, scale, dtype):
    """t's float8 bits with this scale (one scale, or rowwise ones broadcast over ``t``), as torchao's
    hp_tensor_and_scale_to_float8 makes them (fused on CUDA); a weight's transpose keeps its layout."""
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous() and scale.numel() == 1:
        return _fused(_bits, t)(t.t(), scale, dtype).t()
    return _fused(_bits, t)(t, scale, dtype)


def _cast(t, scale, dtype, mm_config, role, out_dtype=None):
    """t in float8 with this scale, as torchao's hp_tensor_and_scale_to_float8 casts it; products with
    it come out in ``out_dtype`` (t's dtype unless given: the float32 weight gradient of the fusion)."""
    _, tensor, _ = torchao_float8()
    bits = float8_bits(t, scale, dtype)
    return tensor.Float8TrainingTensor(bits, scale, out_dtype or t.dtype, linear_mm_config=mm_config,
                                       gemm_input_role=role)


def _rows_for_wgrad(t):
    """``t`` [M, ...] with zero rows up to a multiple of 16 on CUDA (the weight gradient's inner
    dimension, which torch._scaled_mm needs divisible by 16 there); zero rows change neither the
    amax nor the product."""
    pad = -t.shape[0] % 16
    if not t.is_cuda or not pad:
        return t
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def _mm(a, b):
    """[m, k] x [k, n] of two Float8TrainingTensors (torch._scaled_mm), reshaped from/to ``a``'s leading dims."""
    if a.dim() == 2:
        return torch.mm(a, b)
    out = torch.mm(a.reshape(-1, a.shape[-1]), b)
    return out.reshape(*a.shape[:-1], out.shape[-1])


class _State:
    """Per product: the recipe, torchao's configs, roles and dtypes."""

    def __init__(self, recipe: Float8Recipe):
        _, tensor, _ = torchao_float8()
        self.recipe = recipe
        self.mm_config = recipe.mm_config()
        self.fwd_dtype, self.grad_dtype = FP8_DTYPES[recipe.fmt]
        self.roles = tensor.GemmInputRole


def _gather_sequence(input, tp_group):
    """The sequence-parallel all-gather of layers.py:553-558 (megatron's global buffer, tag "mpu")."""
    from megatron.core.tensor_parallel import layers  # its module globals, as its own code reads them

    dim_size = list(input.size())
    dim_size[0] = dim_size[0] * tp_group.size()
    buffer = layers.get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
    layers.dist_all_gather_func(buffer, input, group=tp_group)
    return buffer


class Float8LinearWithGradAccumulation(torch.autograd.Function):
    """megatron's LinearWithGradAccumulationAndAsyncCommunication (layers.py:525) with torchao's
    float8 products."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                tp_group, state):
        main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        total_input = _gather_sequence(input, tp_group) if sequence_parallel else input
        amax_in, amax_w = _amax((total_input, weight), tp_group)
        scale_in, scale_w = _scale(amax_in, state.fwd_dtype), _scale(amax_w, state.fwd_dtype)
        x8 = _cast(total_input, scale_in, state.fwd_dtype, state.mm_config, state.roles.INPUT)
        w8t = _cast(weight.t(), scale_w, state.fwd_dtype, state.mm_config, state.roles.WEIGHT)
        output = _mm(x8, w8t)
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(input, weight, scale_in, scale_w)
        ctx.main_grad = main_grad
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.tp_group = tp_group
        ctx.state = state
        return output

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.tensor_parallel import layers  # its module globals, as its own code reads them

        input, weight, scale_in, scale_w = ctx.saved_tensors
        state, tp_group = ctx.state, ctx.tp_group
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad
        handle = None
        if ctx.sequence_parallel:  # layers.py:605-615: the input gathered again while dgrad runs
            dim_size = list(input.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            total_input = layers.get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")
            handle = layers.dist_all_gather_func(total_input, input, group=tp_group, async_op=True)
        else:
            total_input = input
        (amax_go,) = _amax((grad_output,), tp_group)
        scale_go = _scale(amax_go, state.grad_dtype)
        go8 = _cast(grad_output.reshape(-1, grad_output.shape[-1]), scale_go, state.grad_dtype, state.mm_config,
                    state.roles.GRAD_OUTPUT)
        w8t = _cast(weight.t(), scale_w, state.fwd_dtype, state.mm_config, state.roles.WEIGHT)
        grad_input = torch.mm(go8, w8t.t()).reshape(*grad_output.shape[:-1], weight.shape[1])
        if handle is not None:
            handle.wait()
        grad_output, total_input = layers.prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        if ctx.allreduce_dgrad:  # layers.py:633
            handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
        if ctx.sequence_parallel:  # layers.py:638-647
            assert not ctx.allreduce_dgrad
            sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype, device=input.device)
            handle = layers.dist_reduce_scatter_func(sub_grad_input, grad_input, group=tp_group, async_op=True)

        fused = ctx.gradient_accumulation_fusion
        # the weight gradient: float32 straight into main_grad with the fusion (as the fused kernel
        # accumulates), else in the parameter's dtype (torchao's Float8Linear)
        out_dtype = weight.main_grad.dtype if fused else None
        if state.recipe.wgrad:
            x8 = _cast(_rows_for_wgrad(total_input), scale_in, state.fwd_dtype, state.mm_config, state.roles.INPUT,
                       out_dtype)
            go8 = _cast(_rows_for_wgrad(grad_output), scale_go, state.grad_dtype, state.mm_config,
                        state.roles.GRAD_OUTPUT, out_dtype)
            wgrad = torch.mm(go8.t(), x8)
        else:  # --no-fp8-wgrad: megatron's own product (layers.py:677)
            wgrad = grad_output.t().matmul(total_input)
        if fused:
            if hasattr(weight, "__fsdp_param__"):  # Megatron-FSDP: its main-grad buffer (layers.py:655)
                weight.main_grad = weight.get_main_grad()
            weight.main_grad.add_(wgrad.to(weight.main_grad.dtype))
            if hasattr(weight, "grad_added_to_main_grad"):  # layers.py:679-705
                shape, zero = weight.main_grad.shape, getattr(weight, "zero_out_wgrad", False)
                grad_weight = (torch.zeros if zero else torch.empty)(shape, dtype=input.dtype, device=input.device)
                weight.grad_added_to_main_grad = True
            else:
                grad_weight = None
        else:
            grad_weight = wgrad
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        if ctx.sequence_parallel:
            handle.wait()
            return sub_grad_input, grad_weight, grad_bias, None, None, None, None, None
        if ctx.allreduce_dgrad:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class Float8LinearWithFrozenWeight(torch.autograd.Function):
    """megatron's LinearWithFrozenWeight (layers.py:404) with torchao's float8 products: forward and
    input gradient, no weight gradient (LoRA's frozen base)."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group, state):
        amax_in, amax_w = _amax((input, weight), tp_group)
        scale_w = _scale(amax_w, state.fwd_dtype)
        x8 = _cast(input, _scale(amax_in, state.fwd_dtype), state.fwd_dtype, state.mm_config, state.roles.INPUT)
        output = _mm(x8, _cast(weight.t(), scale_w, state.fwd_dtype, state.mm_config, state.roles.WEIGHT))
        if bias is not None:
            output = output + bias
        ctx.save_for_backward(weight, scale_w)
        ctx.allreduce_dgrad, ctx.tp_group, ctx.state = allreduce_dgrad, tp_group, state
        return output

    @staticmethod
    def backward(ctx, grad_output):
        weight, scale_w = ctx.saved_tensors
        state = ctx.state
        (amax_go,) = _amax((grad_output,), ctx.tp_group)
        go8 = _cast(grad_output.reshape(-1, grad_output.shape[-1]), _scale(amax_go, state.grad_dtype),
                    state.grad_dtype, state.mm_config, state.roles.GRAD_OUTPUT)
        w8t = _cast(weight.t(), scale_w, state.fwd_dtype, state.mm_config, state.roles.WEIGHT)
        grad_input = torch.mm(go8, w8t.t()).reshape(*grad_output.shape[:-1], weight.shape[1])
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None, None


def float8_forward_impl(state: _State):
    """The ``_forward_impl`` of a linear computing in FP8: megatron's arguments (layers.py:1168/:1459)."""
    from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_group_if_none
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    def forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                     grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, gtp_remat_size=1):
        if grad_output_buffer is not None or gtp_remat_size > 1:  # the output layer's; weights sharded by GTP
            raise RuntimeError("FP8 linears defer no weight gradient and take no generalized-TP weight")
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        # the products on [tokens, features]: the functions' outputs are then no views of what they made,
        # so a caller may add to the output in place (megatron's MLP adds a per-token-scaled expert bias,
        # mlp.py:354), as to megatron's own linear's
        if not weight.requires_grad:  # layers.py:1095, linear_with_frozen_weight (:446)
            if sequence_parallel:
                input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
            out = Float8LinearWithFrozenWeight.apply(input.reshape(-1, input.shape[-1]), weight, bias,
                                                     allreduce_dgrad, tp_group, state)
        else:
            out = Float8LinearWithGradAccumulation.apply(input.reshape(-1, input.shape[-1]), weight, bias,
                                                         gradient_accumulation_fusion, allreduce_dgrad,
                                                         sequence_parallel, tp_group, state)
        return out.view(-1, *input.shape[1:-1], out.shape[-1])

    return forward_impl


def use_float8(linear, recipe: Float8Recipe) -> None:
    """``linear`` (a ColumnParallelLinear / RowParallelLinear) computes its products in FP8;
    ``restore_linear`` undoes it. ``linear.float8`` is the recipe (read by the grouped experts)."""
    state = _State(recipe)
    linear._forward_impl = float8_forward_impl(state)
    linear.float8 = state


def restore_linear(linear) -> None:
    for name in ("_forward_impl", "float8"):
        linear.__dict__.pop(name, None)


GROUP_ROWS = 16  # torch._scaled_grouped_mm: each group's rows a multiple of 16 (torchao's MoE path pads them so)
GROUPED_DTYPE = torch.float8_e4m3fn  # the rowwise grouped kernel's operands (torchao's MoE recipe: e4m3 throughout)


def float8_grouped_matmul(x, offsets, linears):
    """The zero-sync grouped experts' ``y[rows of g] = x[rows of g] @ W_g.t()`` (grouped_experts.py
    _GroupedMatmul) in FP8 with torchao's MoE float8 recipe (prototype/moe_training/fp8_grouped_mm.py
    _Float8GroupedMM): rowwise power-of-2 scales, e4m3 operands, every group's rows aligned to 16, one
    ``torch._scaled_grouped_mm`` per product on CUDA. Padding rows (past the last offset) give zeros
    and get zero gradients. Nothing is read on the host."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    row_parallel = isinstance(linears[0], RowParallelLinear)
    return _Float8Grouped.apply(x, offsets, linears[0].float8, linears[0].tp_group, row_parallel,
                                *[lin.weight for lin in linears])


def _aligned_rows(offsets, rows: int):
    """Device-side layout of ``rows`` rows (groups ending at ``offsets``, then padding) in a buffer whose
    groups start at multiples of GROUP_ROWS (zero rows between them). Returns: the source row of each
    buffer row (``rows``: a zero row); the buffer row of each row; [rows, 1] whether a row is a group's
    (not padding); the buffer's group end offsets (int32); the group of each buffer row."""
    groups = offsets.numel()
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    aligned = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    ends = aligned.cumsum(0).to(torch.int32)
    starts, aligned_starts = offsets - counts, ends - aligned
    size = -(-(rows + (GROUP_ROWS - 1) * groups) // GROUP_ROWS) * GROUP_ROWS  # host arithmetic: every fill fits
    slots = torch.arange(size, device=offsets.device, dtype=torch.int32)
    slot_group = torch.searchsorted(ends, slots, right=True).clamp_(max=groups - 1)
    local = slots - aligned_starts[slot_group]
    filled = (local < counts[slot_group]) & (slots < ends[-1])
    source = torch.where(filled, starts[slot_group] + local, rows)
    row_ids = torch.arange(rows, device=offsets.device, dtype=torch.int32)
    row_group = torch.searchsorted(offsets, row_ids, right=True).clamp_(max=groups - 1)
    target = (aligned_starts[row_group] + row_ids - starts[row_group]).clamp_(max=size - 1)
    valid = (row_ids < offsets[-1]).unsqueeze(1)
    return source.long(), target.long(), valid, ends, slot_group


def _gather_rows(t, source):
    """The buffer: row ``source[i]`` of ``t`` (one zero row past its end)."""
    return torch.cat([t, t.new_zeros(1, t.shape[1])]).index_select(0, source)


def _scales(amax):
    """torchao's amax_to_scale with power-of-2 rounding (as its MoE path computes them)."""
    _, _, utils = torchao_float8()
    return utils.amax_to_scale(amax, GROUPED_DTYPE, round_scales_to_power_of_2=True)


def _rowwise(t, dim: int, group=None):
    """t's float8 bits and scales with the amax taken along ``dim`` (torchao's AXISWISE scaling), the
    amax all-reduced (MAX) over ``group``: the dimension is sharded across it."""
    amax = torch.amax(torch.abs(t), dim=dim, keepdim=True)
    if group is not None and group.size() > 1:
        amax = amax.float()
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    scale = _scales(amax)
    return float8_bits(t, scale, GROUPED_DTYPE), scale


def _per_group_columns(t, slot_group, groups: int):
    """t's float8 bits with per-(group, column) scales over each group's rows (the weight gradient's
    operands, torchao's torch_to_float8_per_group_colwise) and those scales [groups, columns]:
    a device-side segment amax, no host read."""
    index = slot_group.long().unsqueeze(1).expand(-1, t.shape[1])
    amax = t.new_zeros(groups, t.shape[1], dtype=torch.float32).scatter_reduce_(
        0, index, t.abs().to(torch.float32), reduce="amax")
    scale = _scales(amax)
    return float8_bits(t, scale.index_select(0, slot_group.long()), GROUPED_DTYPE), scale


def _column_major(t):
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def scaled_grouped_mm(a, b, scale_a, scale_b, offsets):
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets)`` into bf16 (the kernel's only
    output type): 2-D x 3-D (groups of a's rows) or 2-D x 2-D (groups of the shared dimension, a
    [groups, m, n] result). On CUDA the kernel; elsewhere (no kernel) its arithmetic on the device:
    the FP8 values' products (bf16 holds every FP8 value) summed in float32 and rounded to bf16 by
    torch._grouped_mm, times the scales: powers of 2, so rounding before them is rounding after."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    products = torch._grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs=offsets).to(torch.float32)
    groups = offsets.numel()
    if b.dim() == 3:
        rows = torch.arange(a.shape[0], device=a.device, dtype=torch.int32)
        row_group = torch.searchsorted(offsets, rows, right=True).clamp_(max=groups - 1)
        scaled = products * scale_a.unsqueeze(1) * scale_b.index_select(0, row_group.long())
    else:
        scaled = products * scale_a.view(groups, -1, 1) * scale_b.view(groups, 1, -1)
    return scaled.to(torch.bfloat16)


class _Float8Grouped(torch.autograd.Function):
    """torchao's _Float8GroupedMM on the zero-sync experts' buffer: the rows regrouped on the device
    into groups of multiples of 16 (torchao asks its caller to), rowwise scales for the forward and
    input-gradient products, per-group column scales for the weight gradient. An expert-TP shard's
    amax over a sharded contraction dimension is all-reduced (forward of a row-parallel linear,
    input gradient of a column-parallel one), so expert TP uses expert TP1's scales. Keeps for
    backward what the high-precision grouped product keeps: the input, the offsets, the weights."""

    @staticmethod
    def forward(ctx, x, offsets, state, tp_group, row_parallel, *weights):
        source, target, valid, ends, _ = _aligned_rows(offsets, x.shape[0])
        w = torch.stack([wi.detach() for wi in weights])  # [G, out, in]
        a8, scale_a = _rowwise(_gather_rows(x, source), -1, tp_group if row_parallel else None)
        w8, scale_w = _rowwise(w, -1, tp_group if row_parallel else None)
        out = scaled_grouped_mm(a8, w8.transpose(-2, -1), scale_a.reciprocal().squeeze(-1),
                                scale_w.reciprocal().squeeze(-1), ends)
        ctx.save_for_backward(x, offsets, *[wi.detach() for wi in weights])
        ctx.state, ctx.tp_group, ctx.row_parallel = state, tp_group, row_parallel
        y = out.index_select(0, target).to(x.dtype)
        return torch.where(valid, y, torch.zeros((), dtype=y.dtype, device=y.device))

    @staticmethod
    def backward(ctx, dy):
        x, offsets, *weights = ctx.saved_tensors
        source, target, valid, ends, slot_group = _aligned_rows(offsets, x.shape[0])
        w = torch.stack(weights)
        go = _gather_rows(torch.where(valid, dy, torch.zeros((), dtype=dy.dtype, device=dy.device)), source)
        sharded = None if ctx.row_parallel else ctx.tp_group  # the input gradient contracts the output's shard
        go8, scale_go = _rowwise(go, -1, sharded)
        wt8, scale_wt = _rowwise(w, -2, sharded)  # per (expert, input column), over the outputs
        dx = scaled_grouped_mm(go8, _column_major(wt8), scale_go.reciprocal().squeeze(-1),
                               scale_wt.reciprocal().squeeze(-2).contiguous(), ends)
        dx = torch.where(valid, dx.index_select(0, target).to(x.dtype), torch.zeros((), dtype=x.dtype,
                                                                                    device=x.device))
        if not any(ctx.needs_input_grad[5:]):  # frozen weights (LoRA's base): no weight gradient
            return (dx, None, None, None, None, *[None] * len(weights))
        a = _gather_rows(x, source)
        groups = offsets.numel()
        if ctx.state.recipe.wgrad:
            go8_g, scale_go_g = _per_group_columns(go, slot_group, groups)
            a8_g, scale_a_g = _per_group_columns(a, slot_group, groups)
            dw = scaled_grouped_mm(go8_g.t().contiguous(), _column_major(a8_g),
                                   scale_go_g.reciprocal().flatten(), scale_a_g.reciprocal().flatten(), ends)
        else:  # --no-fp8-wgrad: the high-precision grouped product (grouped_experts.py)
            dw = torch._grouped_mm(go.t(), a, offs=ends)
        has_rows = (torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).view(-1, 1, 1)
        dw = torch.where(has_rows, dw, torch.zeros((), dtype=dw.dtype, device=dw.device)).to(w.dtype)
        return (dx, None, None, None, None, *dw.unbind(0))
