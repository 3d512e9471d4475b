"""The run as the planner reads it: its layer kinds, its recompute, the fixed dispatch budget of its
MoE dispatcher (the runtime's own ``budget_rows``), and its TransformerConfig built as this machine
can (the local spec without fused kernels; sizes unchanged). Used by the trace, the memory model and
the step time alike."""
from __future__ import annotations

import copy


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


def buildable_here(args):
    """A copy of the arguments whose TransformerConfig this machine can build (sizes unchanged)."""
    a = copy.copy(args)
    local_unfused(a)
    return a


def recompute_of(args) -> str:
    """The run's recompute: "none", "selective" (its --recompute-modules) or "full"."""
    g = getattr(args, "recompute_granularity", None)
    return g if g in ("selective", "full") else "none"


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
    if not (getattr(args, "moe_zero_sync_dropless", False) and getattr(args, "moe_sync_free_dispatcher", False)
            and args.moe_token_dispatcher_type == "alltoall" and args.num_experts):
        return None
    from megatron_ext.moe.fixed_dispatch import budget_rows

    tokens = args.seq_length * args.micro_batch_size // tp
    return ep * budget_rows(tokens, args.moe_router_topk or 1, args.num_experts, args.num_experts // ep,
                            getattr(args, "moe_dropless_budget_factor", None))[0]
