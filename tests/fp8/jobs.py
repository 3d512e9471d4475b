"""Job functions for the FP8 tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import arguments

import contextlib
import copy

import torch

S, B, H, F = 32, 2, 64, 128  # sequence, micro-batch, hidden, MLP width


def _config(sequence_parallel: bool, dtype):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=torch.distributed.get_world_size() if sequence_parallel
                               else 1, sequence_parallel=sequence_parallel, params_dtype=dtype,
                               use_cpu_initialization=True, perform_initialization=False)


def _pair(config):
    """megatron's MLP pair: a ColumnParallelLinear into a RowParallelLinear."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    init = torch.nn.init.zeros_
    fc1 = ColumnParallelLinear(H, F, config=config, init_method=init, bias=False, gather_output=False)
    fc2 = RowParallelLinear(F, H, config=config, init_method=init, bias=False, input_is_parallel=True,
                            skip_bias_add=False)
    return fc1, fc2


def _data(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=g).to(dtype)
    w1 = (torch.randn(F, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(H, F, generator=g) * 0.1).to(dtype)
    dy = torch.randn(S, B, H, generator=g).to(dtype)
    return x, w1, w2, dy


def _run_pair(fc1, fc2, x, dy):
    x = x.clone().requires_grad_(True)
    h, _ = fc1(x)
    y, _ = fc2(torch.relu(h))
    y.backward(dy)
    return y.detach(), x.grad, fc1.weight.grad, fc2.weight.grad


def linear_numerics(fmt: str = "hybrid") -> dict:
    """At TP1: megatron's pair in FP8 against torchao's Float8Linear on the same inputs (bf16, bitwise)
    and against the pair in high precision; the weight gradient accumulated into main_grad (fusion);
    then TP2 + sequence parallelism against TP1 (float32: the row-parallel sum's order is the only
    difference)."""
    from megatron_ext.seams import fp8 as seam
    from megatron_ext.seams.fp8 import Float8LinearWithGradAccumulation, Float8Recipe, _State
    from megatron_ext.training import parallel

    rank = torch.distributed.get_rank()
    recipe = Float8Recipe(fmt=fmt)
    out = {}
    try:
        parallel.initialize(tensor=1)
        # torchao's Float8Linear on the same weights and inputs
        config, _, _ = seam.torchao_float8()
        from torchao.float8.float8_linear import Float8Linear

        x, w1, w2, dy = _data(torch.bfloat16)
        fc1, fc2 = _pair(_config(False, torch.bfloat16))
        with torch.no_grad():
            fc1.weight.copy_(w1)
            fc2.weight.copy_(w2)
        high = _run_pair(fc1, fc2, x, dy)
        results = {}
        for name in ("hybrid", "e4m3"):  # --fp8-format: e5m2 or e4m3 output gradients
            r = Float8Recipe(fmt=name)
            ref1 = Float8Linear(H, F, bias=False, config=r.torchao_config(), dtype=torch.bfloat16)
            ref2 = Float8Linear(F, H, bias=False, config=r.torchao_config(), dtype=torch.bfloat16)
            with torch.no_grad():
                ref1.weight.copy_(w1)
                ref2.weight.copy_(w2)
            xr = x.clone().requires_grad_(True)
            yr = ref2(torch.relu(ref1(xr)))
            yr.backward(dy)
            torchao_result = (yr.detach(), xr.grad, ref1.weight.grad, ref2.weight.grad)
            for lin in (fc1, fc2):
                lin.weight.grad = None
                seam.use_float8(lin, r)
            ours = _run_pair(fc1, fc2, x, dy)
            out[f"bitwise_vs_torchao_{name}"] = [torch.equal(a, b) for a, b in zip(ours, torchao_result)]
            if name == fmt:
                out["differs_from_high_precision"] = [not torch.equal(a, b) for a, b in zip(ours, high)]
                out["close_to_high_precision"] = [((a.float() - b.float()).norm() / b.float().norm()).item()
                                                  for a, b in zip(ours, high)]
            results[name] = ours
        out["formats_differ"] = [not torch.equal(a, b) for a, b in zip(results["hybrid"], results["e4m3"])]

        # gradient-accumulation fusion: the weight gradient added to main_grad in float32
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        xi = x.float().reshape(S * B, H)
        gy = torch.randn(S * B, F, generator=torch.Generator().manual_seed(1))
        w = w1.float().clone().requires_grad_(True)
        w.main_grad = torch.full_like(w, 0.5)
        w.grad_added_to_main_grad = False
        Float8LinearWithGradAccumulation.apply(xi, w, None, True, False, False, group, _State(recipe)).backward(gy)
        w_plain = w1.float().clone().requires_grad_(True)
        Float8LinearWithGradAccumulation.apply(xi, w_plain, None, False, False, False, group,
                                               _State(recipe)).backward(gy)
        out["main_grad_fused"] = bool(torch.equal(w.main_grad, w_plain.grad + 0.5) and w.grad_added_to_main_grad)

        # --no-fp8-wgrad, hybrid: the weight gradient is megatron's high-precision product (layers.py:677), the
        # rest FP8's
        w_hp = w1.float().clone().requires_grad_(True)
        xh = xi.clone().requires_grad_(True)
        Float8LinearWithGradAccumulation.apply(xh, w_hp, None, False, False, False, group,
                                               _State(Float8Recipe(fmt=fmt, wgrad=False))).backward(gy)
        out["no_fp8_wgrad"] = bool(torch.equal(w_hp.grad, gy.t().matmul(xi)) and not torch.equal(w_hp.grad, w_plain.grad))

        # a frozen weight (LoRA's base): the same output and input gradient as the trainable path
        w_frozen = w1.float()
        xf = x.float().clone().requires_grad_(True)
        yf = seam.float8_forward_impl(_State(recipe))(xf, w_frozen, None, False, False, False, tp_group=group)
        yf.backward(gy.reshape(S, B, F))
        xt = x.float().clone().requires_grad_(True)
        yt = Float8LinearWithGradAccumulation.apply(xt, w1.float().requires_grad_(True), None, False, False, False,
                                                    group, _State(recipe))
        yt.backward(gy.reshape(S, B, F))
        out["frozen_equals_trainable"] = bool(torch.equal(yf, yt) and torch.equal(xf.grad, xt.grad))

        # megatron's MLP adds to its fc2's output in place (the expert bias scaled per token, mlp.py:354), as
        # megatron's own linear allows: the same output and gradients as adding out of place
        def add_one(in_place: bool):
            xi, wi = x.float().clone().requires_grad_(True), w1.float().clone().requires_grad_(True)
            y = seam.float8_forward_impl(_State(recipe))(xi, wi, None, False, False, False, tp_group=group)
            if in_place:
                y += 1.0
            else:
                y = y + 1.0
            y.backward(gy.reshape(S, B, F))
            return y.detach(), xi.grad, wi.grad
        out["in_place_add"] = all(torch.equal(a, b) for a, b in zip(add_one(True), add_one(False)))

        # TP2 + SP against TP1, float32
        x, w1, w2, dy = _data(torch.float32)
        fc1, fc2 = _pair(_config(False, torch.float32))
        with torch.no_grad():
            fc1.weight.copy_(w1)
            fc2.weight.copy_(w2)
        for lin in (fc1, fc2):
            seam.use_float8(lin, recipe)
        tp1 = _run_pair(fc1, fc2, x, dy)

        parallel.initialize(tensor=2)
        fc1, fc2 = _pair(_config(True, torch.float32))
        rows = slice(rank * F // 2, (rank + 1) * F // 2)
        seq = slice(rank * S // 2, (rank + 1) * S // 2)
        with torch.no_grad():
            fc1.weight.copy_(w1[rows])
            fc2.weight.copy_(w2[:, rows])
        for lin in (fc1, fc2):
            seam.use_float8(lin, recipe)
        y, gx, g1, g2 = _run_pair(fc1, fc2, x[seq], dy[seq])
        pieces = [y, gx, g1, g2]
        full = []
        for t, dim in zip(pieces, (0, 0, 0, 1)):
            parts = [torch.empty_like(t) for _ in range(2)]
            torch.distributed.all_gather(parts, t.contiguous())
            full.append(torch.cat(parts, dim))
        out["tp2_sp_rel"] = [((a - b).norm() / b.norm()).item() for a, b in zip(full, tp1)]
    finally:
        parallel.destroy()
    return out


COUNTS, PADDING = [5, 0, 11, 20], 4  # expert rows (one expert without rows, none a multiple of 16), padding rows


def _grouped_data(g, width_in, width_out):
    xs = torch.randn(sum(COUNTS) + PADDING, width_in, generator=g).to(torch.bfloat16)
    ws = [(torch.randn(width_out, width_in, generator=g) * 0.1).to(torch.bfloat16) for _ in COUNTS]
    gy = torch.randn(sum(COUNTS) + PADDING, width_out, generator=g).to(torch.bfloat16)
    return xs, ws, gy


def _grouped_run(product, xs, ws, gy):
    """(output, input gradient, each expert's weight gradient) of ``product(x, weights)``."""
    x = xs.clone().requires_grad_(True)
    w = [wi.clone().requires_grad_(True) for wi in ws]
    y = product(x, w)
    y.backward(gy)
    return [y.detach(), x.grad, *[wi.grad for wi in w]]


def _column_major(t):
    """The same values, column-major in the last two dimensions (the layout torchao's kernels hand back)."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


@contextlib.contextmanager
def _torchao_grouped_on_cpu():
    """torchao's _Float8GroupedMM runnable on a CPU: its Triton kernels replaced by torchao's own torch
    references of them (prototype/moe_training/utils.py, float8_utils.py), the CUDA kernel
    torch._scaled_grouped_mm by the seam's arithmetic of it (compared with torch._scaled_mm apart)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_scale, to_fp8_saturated
    from torchao.prototype.moe_training import fp8_grouped_mm as ao, utils

    from megatron_ext.seams import fp8 as seam

    def axiswise(t, dtype, dim):
        scale = tensor_to_scale(t, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                                round_scales_to_power_of_2=True)
        return to_fp8_saturated(t.to(torch.float32) * scale, dtype), scale

    def rowwise_2d(t, output_dtype, round_scales_to_power_of_2):
        return axiswise(t, output_dtype, -1)

    def colwise_3d(b_t, output_dtype, round_scales_to_power_of_2):  # (E, K, N) column-major, scales (E, 1, N)
        data, scale = axiswise(b_t, output_dtype, -2)
        return _column_major(data), scale

    def transpose_rhs(b_t, output_dtype, round_scales_to_power_of_2):
        return utils.torch_to_3d_rowwise_float8_transpose_rhs(b_t, output_dtype, True)

    def per_group_colwise(t, offs, dtype):
        """The reference over the groups with rows; an empty group's scales are a zero amax's (as the
        kernel's, whose amax over no rows is 0; the reference cannot reduce over none)."""
        ends = offs.tolist()
        kept = [e for i, e in enumerate(ends) if e > (ends[i - 1] if i else 0)]
        data, scales = utils.torch_to_float8_per_group_colwise(t, torch.tensor(kept, dtype=torch.int32), dtype, True)
        empty = amax_to_scale(torch.zeros(t.shape[1]), dtype, round_scales_to_power_of_2=True)
        per_group, it = [], iter(scales.view(len(kept), -1))
        for i, e in enumerate(ends):
            per_group.append(next(it) if e > (ends[i - 1] if i else 0) else empty)
        return data, torch.cat(per_group)

    def per_group_dual(go, a, offs, dtype, round_scales_to_power_of_2):
        go8, go_scales = per_group_colwise(go, offs, dtype)
        a8, a_scales = per_group_colwise(a, offs, dtype)
        return _column_major(go8), go_scales, _column_major(a8), a_scales

    def kernel(a, b, scale_a, scale_b, offs, out_dtype=None, use_fast_accum=False):
        return seam.scaled_grouped_mm(a, b, scale_a, scale_b, offs)

    swaps = [(ao, "triton_fp8_rowwise_2d_scale_and_cast", rowwise_2d),
             (ao, "triton_fp8_colwise_3d_scale_and_cast", colwise_3d),
             (ao, "triton_fp8_rowwise_3d_transpose_rhs", transpose_rhs),
             (ao, "triton_fp8_per_group_colwise_scales_dual", per_group_dual),
             (torch, "_scaled_grouped_mm", kernel)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    for obj, name, value in swaps:
        setattr(obj, name, value)
    try:
        yield ao._to_fp8_rowwise_then_scaled_grouped_mm
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def grouped_numerics() -> dict:
    """The zero-sync grouped experts' FP8 product (seam.float8_grouped_matmul): against torchao's
    _Float8GroupedMM on the same rows regrouped by hand at multiples of 16 (bitwise), against the
    high-precision grouped product (FP8 applied, and close), its CPU arithmetic of
    torch._scaled_grouped_mm against per-group torch._scaled_mm, and at expert-TP 2 (this world's
    two ranks) against expert-TP 1 for a column- then a row-parallel linear."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_ext.moe.grouped_experts import _GroupedMatmul
    from megatron_ext.seams import fp8 as seam
    from megatron_ext.seams.fp8 import Float8Recipe, _State

    out = {}
    g = torch.Generator().manual_seed(2)
    xs, ws, gy = _grouped_data(g, H, F)
    offsets = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    state = _State(Float8Recipe())

    def ours(x, w, group=None, row_parallel=False):
        linears = [SimpleNamespace(weight=wi, float8=state, tp_group=group) for wi in w]
        if row_parallel:  # the seam tells the two kinds apart by class
            linears = [_as(RowParallelLinear, lin) for lin in linears]
        return seam.float8_grouped_matmul(x, offsets, linears)

    grouped = _grouped_run(ours, xs, ws, gy)

    # torchao on the same rows, regrouped by hand: each expert's rows from a multiple of 16, zeros between
    starts = [0]
    for n in COUNTS:
        starts.append(starts[-1] + -(-n // 16) * 16)
    def regroup(t):
        buf = t.new_zeros(starts[-1], t.shape[1])
        at = 0
        for e, n in enumerate(COUNTS):
            buf[starts[e]:starts[e] + n] = t[at:at + n]
            at += n
        return buf
    def ungroup(t):
        return torch.cat([*[t[starts[e]:starts[e] + n] for e, n in enumerate(COUNTS)],
                          t.new_zeros(PADDING, t.shape[1])])
    ends = torch.tensor(starts[1:], dtype=torch.int32)
    with _torchao_grouped_on_cpu() as torchao_grouped:
        def theirs(x, w):
            b_t = torch.stack(w).transpose(-2, -1)  # (E, K, N) column-major, as torchao takes it
            return ungroup(torchao_grouped(regroup(x), b_t, ends, torch.bfloat16, torch.float8_e4m3fn, False))
        reference = _grouped_run(theirs, xs, ws, gy)
    # padding rows' input gradient: zero in ours; theirs is cut from the regrouped buffer's zeros
    out["bitwise_vs_torchao"] = [bool(torch.equal(a, b)) for a, b in zip(grouped, reference)]

    high = _grouped_run(lambda x, w: _GroupedMatmul.apply(x, offsets, *w), xs, ws, gy)
    # --no-fp8-wgrad: the weight gradients the high-precision grouped product's, on the regrouped rows
    state_hp_wgrad = _State(Float8Recipe(wgrad=False))
    hp_wgrad = _grouped_run(lambda x, w: seam.float8_grouped_matmul(
        x, offsets, [SimpleNamespace(weight=wi, float8=state_hp_wgrad, tp_group=None) for wi in w]), xs, ws, gy)
    out["no_fp8_wgrad"] = [float((a - b).float().abs().max()) for a, b in zip(hp_wgrad[2:], high[2:])]
    out["no_fp8_wgrad_same_dx"] = bool(torch.equal(hp_wgrad[0], grouped[0]) and torch.equal(hp_wgrad[1], grouped[1]))
    rows = sum(COUNTS)
    out["differs_from_high_precision"] = [not torch.equal(a, b) for a, b in zip(grouped, high) if a.abs().sum() > 0]
    out["close_to_high_precision"] = [float((a[:rows] - b[:rows]).float().norm() / b[:rows].float().norm())
                                      for a, b in zip(grouped, high) if b.abs().sum() > 0]
    out["padding_rows_zero"] = bool(grouped[0][rows:].abs().sum() == 0 and grouped[1][rows:].abs().sum() == 0)

    # the CPU arithmetic of torch._scaled_grouped_mm against torch._scaled_mm per group (2-D x 3-D)
    a8 = (torch.randn(64, H, generator=g) * 4).to(torch.float8_e4m3fn)
    b8 = (torch.randn(3, F, H, generator=g) * 4).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(64, generator=g).exp2().floor().exp2(), torch.rand(3, F, generator=g).mul(4).floor().exp2()
    cuts = [0, 16, 16, 64]
    emulated = seam.scaled_grouped_mm(a8, b8.transpose(-2, -1), sa, sb, torch.tensor(cuts[1:], dtype=torch.int32))
    per_group = torch.cat([torch._scaled_mm(a8[cuts[e]:cuts[e + 1]], b8[e].t(), sa[cuts[e]:cuts[e + 1], None],
                                            sb[e][None, :], out_dtype=torch.bfloat16) for e in range(3)])
    out["kernel_arithmetic_vs_scaled_mm"] = float(((emulated.float() - per_group.float()).abs()
                                                   / per_group.float().abs().clamp(min=1e-30)).max())

    # expert-TP 2 against 1: fc1 column-parallel (outputs split), fc2 row-parallel (inputs split)
    rank, group = torch.distributed.get_rank(), torch.distributed.group.WORLD
    tp_rel = []
    for row_parallel in (False, True):
        xs, ws, gy = _grouped_data(torch.Generator().manual_seed(3), H, F)
        # in the contraction's second half an operand column 2^16 x larger, multiplied by zeros: each
        # row's amax (and so the first half's FP8 values) is the whole row's, not the shard's
        if row_parallel:
            xs[:, -1] *= 65536
            for wi in ws:
                wi[:, -1] = 0
        else:
            gy[:, -1] *= 65536
            gy[:, -2] = 0
            for wi in ws:
                wi[-1] = 0
                wi[-2] *= 65536
        whole = _grouped_run(lambda x, w: ours(x, w, row_parallel=row_parallel), xs, ws, gy)
        if row_parallel:  # this rank's input columns; outputs summed over the ranks
            cols = slice(rank * H // 2, (rank + 1) * H // 2)
            shard = _grouped_run(lambda x, w: ours(x, w, group, True), xs[:, cols].contiguous(),
                                 [wi[:, cols].contiguous() for wi in ws], gy)
            y = shard[0].float()
            torch.distributed.all_reduce(y, group=group)
            pairs = [(y, whole[0]), (shard[1], whole[1][:, cols])] + [(a, b[:, cols]) for a, b in zip(shard[2:], whole[2:])]
        else:  # this rank's output rows of each weight
            rows_ = slice(rank * F // 2, (rank + 1) * F // 2)
            shard = _grouped_run(lambda x, w: ours(x, w, group, False), xs,
                                 [wi[rows_].contiguous() for wi in ws], gy[:, rows_].contiguous())
            dx = shard[1].float()
            torch.distributed.all_reduce(dx, group=group)
            pairs = [(shard[0], whole[0][:, rows_]), (dx, whole[1])] + [(a, b[rows_]) for a, b in zip(shard[2:], whole[2:])]
        tp_rel.append(max(float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)) for a, b in pairs))
    out["expert_tp2_rel"] = tp_rel
    return out


def zero_sync_layer_syncs(dispatcher: str = "alltoall") -> dict:
    """One zero-sync dropless MoELayer at EP2 in bf16 (tests/moe's layer, megatron_ext/moe/audit.py) with
    its experts' linears in FP8, forward and backward under the sync detector (CUDA-faithful residency):
    the host syncs each phase, and whether FP8 changed the output and gradients (same seed without FP8)."""
    from megatron_ext.moe import audit
    from megatron_ext.seams import fp8 as seam
    from megatron_ext.seams import moe as moe_seams
    from megatron_ext.seams.fp8 import Float8Recipe
    from megatron_ext.training import parallel

    parallel.initialize(expert=2)
    try:
        spec = audit.LayerSpec(dispatcher=dispatcher, mode="dropless-syncfree", experts=4, topk=2, hidden=32,
                               ffn=64, ep=2, dtype="bfloat16")
        x, g = audit.rank_inputs(spec, seq=24, batch=2, seed=5)
        runs = {}
        for fp8 in (False, True):
            moe_seams.reset_moe_aux_loss_scale()
            layer = audit.build_layer(spec, seed=5, ours=True)
            if fp8:
                for expert in layer.experts.local_experts:
                    for linear in (expert.linear_fc1, expert.linear_fc2):
                        seam.use_float8(linear, Float8Recipe())
            runs[fp8] = audit.run_layer(layer, x, g)
        plain, fp8 = runs[False], runs[True]
        return {"syncs": (fp8.syncs_forward, fp8.syncs_backward), "sites": fp8.sites,
                "differs": [not torch.equal(plain.out, fp8.out), not torch.equal(plain.dx, fp8.dx)]
                + [not torch.equal(plain.dw[k], fp8.dw[k]) for k in plain.dw if "experts" in k],
                "close": max(float((plain.out - fp8.out).float().norm() / plain.out.float().norm()),
                             float((plain.dx - fp8.dx).float().norm() / plain.dx.float().norm()))}
    finally:
        moe_seams.reset_moe_aux_loss_scale()
        parallel.destroy()


CAST_SHAPES = ((64, 128, 32), (96, 160, 48), (128, 256, 40), (64, 192, 24), (160, 96, 56))  # hidden, ffn, tokens


def compiled_casts() -> dict:
    """The FP8 casts and amaxes compiled as on CUDA (seams/fp8.py compiled_cast; dynamo's eager backend,
    not inductor: the guards and so the recompiles are dynamo's either way) through megatron's linear
    pairs of other shapes and token counts, forward and backward, bf16: the graphs dynamo made after
    each pair, and each pair's output and gradients against the eager casts' (bitwise)."""
    import torch._dynamo as dynamo
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from torch._dynamo.utils import counters

    from megatron_ext.platform import cpu_shims
    from megatron_ext.seams import fp8 as seam
    from megatron_ext.seams.fp8 import Float8Recipe
    from megatron_ext.training import parallel

    parallel.initialize(tensor=1)
    try:
        def pair_run(hidden, ffn, tokens):
            g = torch.Generator().manual_seed(hidden + ffn + tokens)
            config = _config(False, torch.bfloat16)
            fc1 = ColumnParallelLinear(hidden, ffn, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                       gather_output=False)
            fc2 = RowParallelLinear(ffn, hidden, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                    input_is_parallel=True, skip_bias_add=False)
            with torch.no_grad():
                fc1.weight.copy_(torch.randn(ffn, hidden, generator=g) * 0.1)
                fc2.weight.copy_(torch.randn(hidden, ffn, generator=g) * 0.1)
            for lin in (fc1, fc2):
                seam.use_float8(lin, Float8Recipe())
            x = torch.randn(tokens, 2, hidden, generator=g).to(torch.bfloat16)
            dy = torch.randn(tokens, 2, hidden, generator=g).to(torch.bfloat16)
            return _run_pair(fc1, fc2, x, dy)

        eager = [pair_run(*shape) for shape in CAST_SHAPES]
        graphs, same = [], []
        original = seam._fused
        with cpu_shims.without("eager_jit_fuser"), torch.compiler.set_stance("default", force_backend="eager"):
            dynamo.reset()
            before = counters["stats"]["unique_graphs"]
            seam._fused = lambda fn, t: seam.compiled_cast(fn)  # as on CUDA
            try:
                for shape, reference in zip(CAST_SHAPES, eager):
                    got = pair_run(*shape)
                    graphs.append(counters["stats"]["unique_graphs"] - before)
                    same.append(all(torch.equal(a, b) for a, b in zip(got, reference)))
            finally:
                seam._fused = original
                dynamo.reset()
        return dict(graphs=graphs, same=same)
    finally:
        parallel.destroy()


def _as(cls, namespace):
    """An instance of ``cls`` (not initialised) with the namespace's attributes."""
    obj = object.__new__(cls)
    torch.nn.Module.__init__(obj)
    for k, v in vars(namespace).items():
        object.__setattr__(obj, k, v)
    return obj


def train(argvs: dict) -> dict:
    """The training loop of each run in turn; {name: (its logged losses, FP8 linears per chunk)}."""
    from megatron_ext import fp8
    from megatron_ext.training.run import Run

    out = {}
    for name, argv in argvs.items():
        with Run.from_argv(list(argv), parse=arguments.parse) as run:
            history = run.train()
            n_fp8 = sum(1 for chunk in run.model for m in chunk.modules() if getattr(m, "float8", None) is not None)
            names = sorted(name for name, _ in fp8.float8_linears(run.args, run.model))
            # --first-last-layers-bf16 on the same model: which linears stay in high precision
            kept = copy.copy(run.args)
            kept.first_last_layers_bf16, kept.num_layers_at_start_in_bf16, kept.num_layers_at_end_in_bf16 = True, 1, 0
            out[name] = dict(losses=[h["lm loss"] for h in history], fp8_linears=n_fp8, names=names,
                             names_first_bf16=sorted(n for n, _ in fp8.float8_linears(kept, run.model)))
    return out


def build(argv) -> None:
    """The model of ``argv`` built with its capabilities (a refusal raised as it is built comes back)."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.training.run import Run

    try:
        with Run.from_argv(list(argv), parse=arguments.parse) as run:
            run.build()
    except ConfigError as e:
        return str(e)
    return None


def compose(argv, save: str) -> dict:
    """FP8 with offload, checkpoints and LoRA, every run through the training loop: {name: history}
    (the offload manager's offloaded bytes for the offloaded run; the FP8 linears of the LoRA run)."""
    import train as entry

    from megatron_ext import offload

    offloaded = ["--activation-offload-modules", "core_attention", "qkv_linear", "attn_proj",
                 "--activation-offload-min-tensor-kb", "1"]
    out = {}
    out["straight"] = entry.main([*argv, "--train-iters", "3"])
    try:
        out["offloaded"] = entry.main([*argv, "--train-iters", "3", *offloaded])
        out["offloaded_bytes"] = offload.current().stats["offloaded_bytes"]
    finally:
        offload.detach()
    out["first"] = entry.main([*argv, "--train-iters", "3", "--save", save, "--save-interval", "2",
                               "--exit-interval", "2"])
    out["resumed"] = entry.main([*argv, "--train-iters", "3", "--load", save])
    high = [a for i, a in enumerate(argv) if a not in ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")]
    out["high_precision_from_fp8"] = entry.main([*high, "--train-iters", "3", "--load", save])
    # LoRA: the frozen base's products in FP8, the adapters' in high precision
    out["lora"] = train({"lora": [*argv, "--train-iters", "3", "--lora-rank", "4"]})["lora"]
    return out
