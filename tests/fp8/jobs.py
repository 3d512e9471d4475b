"""Job functions for the FP8 tests (run on every rank of a gloo world, see tests/dist.py)."""
from __future__ import annotations

import arguments

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

        # the zero-sync grouped experts' product (padding rows at the end) against each expert's own
        # FP8 linear on its rows
        from types import SimpleNamespace

        g = torch.Generator().manual_seed(2)
        counts, padding = [5, 0, 11], 4
        xs = torch.randn(sum(counts) + padding, H, generator=g).to(torch.bfloat16)
        ws = [(torch.randn(F, H, generator=g) * 0.1).to(torch.bfloat16).requires_grad_(True) for _ in counts]
        gy = torch.randn(sum(counts) + padding, F, generator=g).to(torch.bfloat16)
        linears = [SimpleNamespace(weight=w, float8=_State(recipe), tp_group=group) for w in ws]
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
        xg = xs.clone().requires_grad_(True)
        yg = seam.float8_grouped_matmul(xg, offsets, linears)
        yg.backward(gy)
        grouped = [yg.detach(), xg.grad, *[w.grad.clone() for w in ws]]
        each_y, each_dx, each_dw = [], [], []
        start = 0
        for n, w in zip(counts, ws):
            w.grad = None
            xe = xs[start:start + n].clone().requires_grad_(True)
            ye = Float8LinearWithGradAccumulation.apply(xe, w, None, False, False, False, group, _State(recipe))
            ye.backward(gy[start:start + n])
            each_y.append(ye.detach())
            each_dx.append(xe.grad)
            each_dw.append(w.grad if w.grad is not None else torch.zeros_like(w))
            start += n
        zeros = torch.zeros(padding, F, dtype=torch.bfloat16)
        expected = [torch.cat([*each_y, zeros]), torch.cat([*each_dx, torch.zeros(padding, H, dtype=torch.bfloat16)]),
                    *each_dw]
        out["grouped_vs_each_expert"] = [torch.equal(a, b) for a, b in zip(grouped, expected)]

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
