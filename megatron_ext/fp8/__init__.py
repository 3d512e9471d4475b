"""FP8 training on the local spec, through torchao's float8 training. See docs/fp8.md.

Megatron's flags, megatron's meanings: ``--fp8-format e4m3|hybrid --fp8-recipe tensorwise`` with
``--transformer-impl local`` computes the forward, input-gradient and weight-gradient products of
every linear of the transformer layers in FP8 (attention's, the MLP's, multi-latent attention's
projections, the shared and the routed experts'), with torchao's tensorwise scaling
(megatron_ext/seams/fp8.py); the zero-sync grouped experts (``--moe-zero-sync-dropless``) run torchao's
MoE recipe instead (rowwise scales, e4m3 operands, ``torch._scaled_grouped_mm``), the one that kernel
takes. The embedding, the output layer and the router stay in high precision, as transformer-engine's
recipes keep them; ``--first-last-layers-bf16`` keeps
``--num-layers-at-start-in-bf16`` / ``--num-layers-at-end-in-bf16`` layers in high precision too;
``--no-fp8-wgrad`` computes the weight gradients in high precision.

megatron-core's own FP8 paths (every ``config.fp8`` branch) are transformer-engine's: the model's
config is built without ``--fp8-format`` on the local spec (``config_args``), and this package puts
the products in FP8 instead (``before_wrap``). What the local spec cannot run is refused by name
before any compute (``validate``; the recipes torchao lacks: config/rules.py).
"""
from __future__ import annotations

import copy

from megatron_ext.errors import ConfigError

__all__ = ["validate", "before_wrap", "config_args", "enabled", "float8_linears", "recipe", "MULTIPLE"]

MULTIPLE = 16  # torch._scaled_mm on CUDA: both dimensions of every operand divisible by 16
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and later


def enabled(args) -> bool:
    """FP8 through torchao: --fp8-format on the local spec."""
    return args.fp8 is not None and args.transformer_impl == "local"


def recipe(args):
    from megatron_ext.seams.fp8 import Float8Recipe

    return Float8Recipe(fmt=args.fp8, wgrad=args.fp8_wgrad)


def config_args(args):
    """The arguments megatron's config builder reads: FP8 on the local spec left out (its config.fp8
    branches run transformer-engine's code); the run's own arguments otherwise."""
    if not enabled(args):
        return args
    masked = copy.copy(args)
    masked.fp8 = None
    masked.first_last_layers_bf16 = False
    return masked


def summary(args) -> str:
    """The startup summary's line (training/features.py)."""
    if not enabled(args):
        return "fp8: off" if args.fp8 is None else f"fp8: off (--fp8-format {args.fp8} runs in transformer-engine)"
    wgrad = "" if args.fp8_wgrad else ", wgrad in high precision (--no-fp8-wgrad)"
    experts = ("; the zero-sync experts rowwise e4m3 (torchao's MoE recipe, torch._scaled_grouped_mm)"
               if args.moe_zero_sync_dropless else "")
    return f"fp8: {args.fp8} tensorwise through torchao (--fp8-format {args.fp8}){wgrad}{experts}"


def validate(args) -> None:
    if not enabled(args):
        return
    # --fp8-recipe: only tensorwise runs here (config/rules.py refuses the others by name, with the platform's)
    if args.fp8_param_gather:
        raise ConfigError("--fp8-param-gather: the local spec keeps its parameters in high precision and casts "
                          "them to FP8 per product (torchao's float8 training); use transformer-engine for FP8 "
                          "parameters")
    if args.first_last_layers_bf16:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            value = getattr(args, name)
            if not 0 <= value <= per_stage:
                raise ConfigError(f"--{name.replace('_', '-')}={value}: must be between 0 and the layers per "
                                  f"pipeline stage ({per_stage})")
    _check_device(args)


def _check_device(args) -> None:
    """FP8 products need FP8 tensor cores on CUDA (compute capability 8.9 or later)."""
    from megatron_ext.platform.target import DEFAULT_GPU, GPUS, resolve

    target = resolve(args)
    if not target.cuda:
        return
    if target.declared:
        capability = GPUS[target.gpu or DEFAULT_GPU][0]
    else:
        import torch

        capability = torch.cuda.get_device_capability()
    if tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(f"--fp8-format={args.fp8}: FP8 products need a GPU with FP8 tensor cores (compute "
                          f"capability >= 8.9); this one has {capability[0]}.{capability[1]}")


def _high_precision_layer(args, layer_number: int) -> bool:
    """megatron's is_first_last_bf16_layer (core/fp8_utils.py:673) of a 1-based global layer number."""
    if not args.first_last_layers_bf16:
        return False
    index = layer_number - 1
    return index < args.num_layers_at_start_in_bf16 or index >= args.num_layers - args.num_layers_at_end_in_bf16


def float8_linears(args, chunks) -> list:
    """(name, linear) of every ColumnParallelLinear / RowParallelLinear of the transformer layers that
    computes in FP8: not the output layer (nor the embedding or the router, which are no such linears),
    not the layers --first-last-layers-bf16 keeps in high precision."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    found = []
    for chunk in chunks:
        layer_of = {}
        for name, module in chunk.named_modules():
            if isinstance(module, TransformerLayer):
                layer_of[name] = module.layer_number
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            owner = max((p for p in layer_of if name.startswith(p + ".")), key=len, default=None)
            if owner is None or ".mtp." in f".{name}" or _high_precision_layer(args, layer_of[owner]):
                continue
            found.append((name, module))
    return found


def before_wrap(args, chunks) -> None:
    """Every FP8 linear's products through torchao's float8 casts (seams/fp8.py), after refusing a
    weight whose dimensions FP8 products cannot take."""
    if not enabled(args):
        return
    from megatron_ext.seams import fp8 as seam

    linears = float8_linears(args, chunks)
    for name, linear in linears:
        shape = tuple(linear.weight.shape)
        if any(d % MULTIPLE for d in shape):
            raise ConfigError(f"--fp8-format={args.fp8}: {name} has a weight of {list(shape)} on this rank; FP8 "
                              f"products need both dimensions divisible by {MULTIPLE}")
    r = recipe(args)
    for _, linear in linears:
        seam.use_float8(linear, r)
