"""The run as the planner reads it: its layer kinds, its recompute, the fixed dispatch budget of its
MoE dispatcher (the runtime's own ``budget_rows``), and its TransformerConfig built as this machine
can (the local spec without fused kernels; sizes unchanged). Used by the trace, the memory model and
the step time alike."""
from __future__ import annotations

import copy


def local_seq(args) -> int:
    """The sequence positions a context-parallel rank holds (megatron splits every sequence over CP)."""
    return args.seq_length // (args.context_parallel_size or 1)


def local_unfused(a) -> None:
    """In place: the local spec without fused kernels (what this machine builds). The tiny copy
    runs so; the transformer-engine spec saves differently (its fused attention keeps no score
    matrix), which the trace does not see."""
    a.transformer_impl = "local"
    for name, value in list(vars(a).items()):
        if name.startswith("no_") and ("fusion" in name or "persist" in name):
            setattr(a, name, True)
        elif value is True and ("fusion" in name or name in ("persist_layer_norm", "moe_grouped_gemm",
                                                           "moe_use_legacy_grouped_gemm", "tp_comm_overlap")):
            setattr(a, name, False)


def on_transformer_engine(args) -> bool:
    """The run uses megatron's transformer-engine spec (megatron's default; the planner validates for
    a cluster with transformer-engine unless --assume-no-te)."""
    return args.transformer_impl == "transformer_engine"


# recompute modules the local copy cannot build: traced without them, their effect modeled
MODELED_RECOMPUTE = ("moe_act", "layernorm")


def modeled_saved_delta(args, kind: str) -> float:
    """Bytes one layer of ``kind`` saves for backward on the cluster beyond (negative: below) what its
    local-spec trace saves, for the recompute modules the local copy cannot build (docs/planner.md,
    "modeled"), both megatron's output-discarding checkpoints:
    - ``moe_act`` (grouped-GEMM experts only): each routed row's activation output is dropped after
      FC2 has used it and recomputed in backward: tokens per rank x top-k x expert FFN / expert TP;
    - ``layernorm`` (transformer-engine): on the TE spec the attention's norm (and a dense layer's
      pre-MLP norm) is fused into the following linear (TE's LayerNormLinear keeps its normed output
      whatever the recompute), so only a MoE layer's separate pre-MLP norm drops its output:
      tokens per rank x hidden.
    In the activation dtype; 0 for other kinds and recomputes."""
    modules = args.recompute_modules or []
    if kind != "moe" or recompute_of(args) != "selective":
        return 0.0
    elem = 2 if (args.bf16 or args.fp16) else 4
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    tokens = local_seq(args) * args.micro_batch_size // (tp if args.sequence_parallel else 1)
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    delta = 0.0
    if "moe_act" in modules:
        delta -= tokens * (args.moe_router_topk or 1) * ffn // etp * elem
    if "layernorm" in modules:
        delta -= tokens * args.hidden_size * elem
    return float(delta)


def fp8_gemms(args) -> bool:
    """The run's layer GEMMs are transformer-engine's, in FP8 (--fp8-format on the TE spec)."""
    return on_transformer_engine(args) and bool(args.fp8)


def fp8_products(args) -> bool:
    """The layer GEMMs run at the FP8 rate: transformer-engine's FP8, or torchao's float8 products on the
    local spec (megatron_ext/fp8), which keeps what bf16 keeps (no FP8 copies: fp8_gemms is False)."""
    return fp8_gemms(args) or (args.transformer_impl == "local" and args.fp8 is not None)


def fp8_saved_delta(args, gemm_only: float, gemm_shared: float) -> float:
    """Bytes a component saves under FP8 beyond (negative: below) its trace: a layer linear's input
    kept for the weight gradient is transformer-engine's FP8 copy, one byte per element (the
    column-wise data the wgrad GEMM reads; TE's ``_Linear`` / ``_LayerNormLinear`` /
    ``_GroupedLinear`` forward casts the input and saves the quantized tensor); the 16-bit tensor
    is freed unless something else keeps it too (attention's output, kept by the fused attention),
    and then the FP8 copy is on top. ``gemm_only`` / ``gemm_shared``: the traced bytes of the two."""
    if not fp8_gemms(args):
        return 0.0
    elem = 2 if (args.bf16 or args.fp16) else 4
    return -gemm_only * (1 - 1 / elem) + gemm_shared / elem


def buildable_here(args):
    """A copy of the arguments whose TransformerConfig this machine can build (sizes unchanged)."""
    a = copy.copy(args)
    local_unfused(a)
    a.fp8 = None  # FP8 needs transformer-engine to build; the layer layout does not depend on it
    a.fp8_param_gather = False
    if a.recompute_modules:
        a.recompute_modules = [m for m in a.recompute_modules if m not in MODELED_RECOMPUTE] or ["core_attn"]
    return a


def recompute_of(args) -> str:
    """The run's recompute: "none", "selective" (its --recompute-modules) or "full"."""
    g = args.recompute_granularity
    return g if g in ("selective", "full") else "none"


def resolved_recompute(args, recompute=None) -> tuple:
    """(granularity, selective modules) of ``recompute``: None = the run's own (its
    --recompute-granularity and --recompute-modules), "none" / "selective" / "full", or a (granularity,
    modules) pair; selective without modules is core attention, the others have none."""
    if recompute is None:
        recompute = (recompute_of(args), args.recompute_modules)
    granularity, modules = recompute if isinstance(recompute, tuple) else (recompute, None)
    return granularity, tuple(modules or ("core_attn",)) if granularity == "selective" else ()


def layer_kinds(args) -> list:
    """Kinds of the run's decoder layers, in layer order ("dense" / "moe")."""
    n = args.num_layers
    if not args.num_experts:
        return ["dense"] * n
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = list(freq)
    return ["moe" if p else "dense" for p in pattern]


def target_config(args):
    """The run's TransformerConfig, built without a model (as --dry-run does)."""
    import contextlib
    import io

    from megatron.training.arguments import core_transformer_config_from_args

    with contextlib.redirect_stdout(io.StringIO()):  # only its layer layout is read: kernels do not matter
        return core_transformer_config_from_args(buildable_here(args))


def fixed_budget_rows(args, ep: int, tp: int):
    """Rows a rank's experts compute on per MoE layer under --moe-zero-sync-dropless over all-to-all:
    EP x the fixed budget per destination (``megatron_ext.moe.fixed_dispatch.budget_rows``; padding
    rows included). None for other dispatchers."""
    from megatron_ext import moe

    dispatch = moe.MoEOptions.from_args(args)
    if not (dispatch.zero_sync and args.moe_token_dispatcher_type == "alltoall" and args.num_experts):
        return None
    from megatron_ext.moe.fixed_dispatch import budget_rows

    tokens = local_seq(args) * args.micro_batch_size // tp
    return ep * budget_rows(tokens, args.moe_router_topk or 1, args.num_experts, args.num_experts // ep,
                            dispatch.dropless_budget_factor)[0]
