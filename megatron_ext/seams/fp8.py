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
their experts' linears (``linear.float8``) and run each expert's products with that expert's scales:
the numbers megatron's SequentialMLP gives with this seam on each expert's linear.
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
        _, grad_dtype = FP8_DTYPES[self.fmt]
        disabled = config.CastConfig(scaling_type=config.ScalingType.DISABLED)
        hp = dict(cast_config_input_for_grad_weight=disabled, cast_config_grad_output_for_grad_weight=disabled)
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
    compiled = _compiled(fn)
    return lambda x, *rest: compiled(x.detach(), *rest)


def float8_bits(t, scale, dtype):
    """t's float8 bits with this scale, as torchao's hp_tensor_and_scale_to_float8 makes them (fused on
    CUDA); a weight's transpose keeps its layout."""
    if t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous():
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


def float8_grouped_matmul(x, offsets, linears):
    """The zero-sync grouped experts' ``y[rows of g] = x[rows of g] @ W_g.t()`` (grouped_experts.py
    _GroupedMatmul) with each expert's product as its own linear computes it here in FP8: the rows of
    expert g and W_g each cast with their own tensorwise scale. Padding rows (past the last offset)
    give zeros and get zero gradients."""
    return _Float8Grouped.apply(x, offsets, linears[0].float8, linears[0].tp_group,
                                *[lin.weight for lin in linears])


class _Float8Grouped(torch.autograd.Function):
    """Per expert, the products of Float8LinearWithGradAccumulation without communication (the experts'
    linears communicate explicitly: explicit_expert_comm). The rows of each expert are read from the
    offsets on the host: one product per expert (torch._scaled_mm), the CPU path of
    torch._scaled_grouped_mm."""

    @staticmethod
    def forward(ctx, x, offsets, state, tp_group, *weights):
        bounds = [0, *offsets.tolist()]
        y = x.new_zeros(x.shape[0], weights[0].shape[0])
        scales = []
        for g, w in enumerate(weights):
            rows = x[bounds[g]:bounds[g + 1]]
            amax_in, amax_w = _amax((rows, w), tp_group)
            scale_in, scale_w = _scale(amax_in, state.fwd_dtype), _scale(amax_w, state.fwd_dtype)
            scales.append((scale_in, scale_w))
            if rows.shape[0]:
                x8 = _cast(rows, scale_in, state.fwd_dtype, state.mm_config, state.roles.INPUT)
                y[bounds[g]:bounds[g + 1]] = torch.mm(x8, _cast(w.detach().t(), scale_w, state.fwd_dtype,
                                                                state.mm_config, state.roles.WEIGHT))
        ctx.save_for_backward(x, *[w.detach() for w in weights])
        ctx.bounds, ctx.scales, ctx.state, ctx.tp_group = bounds, scales, state, tp_group
        return y

    @staticmethod
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        state, bounds = ctx.state, ctx.bounds
        dx = torch.zeros_like(x)
        dws = []
        need_dw = any(ctx.needs_input_grad[4:])
        for g, w in enumerate(weights):
            rows, go = x[bounds[g]:bounds[g + 1]], dy[bounds[g]:bounds[g + 1]]
            scale_in, scale_w = ctx.scales[g]
            (amax_go,) = _amax((go,), ctx.tp_group)
            scale_go = _scale(amax_go, state.grad_dtype)
            if not go.shape[0]:
                dws.append(torch.zeros_like(w) if need_dw else None)
                continue
            go8 = _cast(go, scale_go, state.grad_dtype, state.mm_config, state.roles.GRAD_OUTPUT)
            w8t = _cast(w.t(), scale_w, state.fwd_dtype, state.mm_config, state.roles.WEIGHT)
            dx[bounds[g]:bounds[g + 1]] = torch.mm(go8, w8t.t())
            if not need_dw:
                dws.append(None)
            elif state.recipe.wgrad:
                x8 = _cast(_rows_for_wgrad(rows), scale_in, state.fwd_dtype, state.mm_config, state.roles.INPUT)
                go8 = _cast(_rows_for_wgrad(go), scale_go, state.grad_dtype, state.mm_config,
                            state.roles.GRAD_OUTPUT)
                dws.append(torch.mm(go8.t(), x8))
            else:
                dws.append(go.t().matmul(rows))
        return (dx, None, None, None, *dws)
