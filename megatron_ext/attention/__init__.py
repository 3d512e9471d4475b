"""Core attention without transformer-engine: megatron's ``--attention-backend`` on the local spec.
See docs/attention.md.

    --attention-backend auto | flash    torch's scaled_dot_product_attention (kernels.py; flex_attention
                                        block masks for masked layers on CUDA) in place of megatron-core's
                                        DotProductAttention (megatron_ext/seams/attention.py)
    --attention-backend unfused | local megatron-core's DotProductAttention (the s x s probabilities)
    --attention-backend fused           transformer-engine's fused (cuDNN) attention: refused on the local spec

With transformer-engine's spec every value keeps its megatron meaning (transformer-engine chooses its
backend from it; ``local`` is refused there: config/rules.py). megatron's default is ``auto``, and the
local spec is what runs where transformer-engine is absent, so ``auto`` runs SDPA there. The choice is
``args.attention_kernel`` (``sdpa``, ``unfused`` or ``transformer_engine``), shown by ``--dry-run``.

Context parallelism (--context-parallel-size N, megatron's --cp-comm-type p2p / all_gather / a2a, one
or one per layer) runs through context_parallel.py with torch's attention; what a comm type cannot
express is refused here by name, naming the one that can.

No flags of its own. Hook: before_validate (features.py): the choice, and what no local core attention
does, refused by name. Read by megatron_ext/seams/attention.py (which core attention the local spec
builds) and megatron_ext/offload/theory.py (what core_attention saves).
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError

_LOCAL_SPEC = {"sdpa": "torch scaled_dot_product_attention",
               "unfused": "megatron's DotProductAttention, unfused"}


def backend_name(args) -> str:
    value = getattr(args, "attention_backend", "auto")
    return str(getattr(value, "name", value))


def resolve(args) -> tuple[str, str]:
    """(kernel, why): the core attention the run's layer spec builds for --attention-backend. Raises
    ConfigError (one line) where the local spec has no such attention."""
    backend = backend_name(args)
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        return "transformer_engine", f"--attention-backend {backend}: transformer-engine's attention chooses by it"
    if backend == "fused":
        raise ConfigError(
            "--attention-backend=fused with --transformer-impl=local: 'fused' is transformer-engine's cuDNN "
            "attention; the local spec runs 'flash' or 'auto' (torch scaled_dot_product_attention) or "
            "'unfused' / 'local' (megatron's DotProductAttention)")
    if backend in ("unfused", "local"):
        return "unfused", f"--attention-backend {backend} on the local spec: {_LOCAL_SPEC['unfused']}"
    return "sdpa", f"--attention-backend {backend} on the local spec: {_LOCAL_SPEC['sdpa']}"


def kernel(args) -> str:
    """The resolved choice (``before_validate``), or resolved now for arguments not parsed here."""
    return getattr(args, "attention_kernel", None) or resolve(args)[0]


def before_validate(args) -> None:
    """The choice, recorded on ``args`` (printed by --dry-run); refusals before megatron asserts."""
    chosen, why = resolve(args)
    args.attention_kernel = chosen
    args.config_sources["attention_kernel"] = f"derived ({why})"
    if chosen == "transformer_engine":
        return
    if args.context_parallel_size > 1:
        _check_context_parallel(args, chosen)
    if backend_name(args) == "local":
        # megatron asserts --spec local with it (training/arguments.py:434): the local layer spec, which
        # this loop builds from --transformer-impl local (a --spec of its own is refused, config/rules.py)
        args.spec = ["local"]
        args.config_sources["spec"] = "derived (--attention-backend local: megatron's local layer spec)"
    if chosen == "sdpa" and args.config_sources.get("create_attention_mask_in_dataloader") == "default" \
            and args.create_attention_mask_in_dataloader and not getattr(args, "reset_attention_mask", False):
        # the data loader's [b, 1, s, s] mask is then the causal triangle the kernel applies by itself;
        # given, it would keep the GPU's flash kernel out (SDPA's flash takes no mask)
        args.create_attention_mask_in_dataloader = False
        args.config_sources["create_attention_mask_in_dataloader"] = (
            "default (off: the causal triangle is torch SDPA's is_causal; --reset-attention-mask keeps the mask)")


def summary(args) -> str:
    """The startup summary's line (training/features.py): the core attention this run builds."""
    chosen, why = resolve(args)
    line = f"attention: {chosen} ({why})"
    if args.context_parallel_size > 1:
        line += f"; context parallel {args.context_parallel_size} ({', '.join(comm_types(args))})"
    return line


_CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


def comm_types(args) -> list[str]:
    """--cp-comm-type as a list (megatron's validate_args makes one value a string)."""
    value = args.cp_comm_type
    return [value] if isinstance(value, str) else list(value)


def _check_context_parallel(args, chosen: str) -> None:
    """What the local spec's context parallelism cannot do, refused by name (one line each)."""
    cp = args.context_parallel_size
    if chosen == "unfused":
        raise ConfigError(
            f"--context-parallel-size={cp} with --attention-backend={backend_name(args)}: megatron's "
            "DotProductAttention attends the whole sequence on one rank (it asserts one CP rank, "
            "transformer/dot_product_attention.py:57); use --attention-backend auto or flash (torch's attention)")
    types = comm_types(args)
    for value in types:
        if value not in _CP_COMM_TYPES:
            raise ConfigError(
                f"--cp-comm-type={value} with --transformer-impl=local: the local spec runs "
                f"{', '.join(_CP_COMM_TYPES)} (a2a+p2p, over --hierarchical-context-parallel-sizes, is "
                "transformer-engine's)")
    tp = args.tensor_model_parallel_size
    if "a2a" in types:
        heads = args.num_attention_heads // tp
        groups = heads if args.multi_latent_attention or not args.group_query_attention \
            else max(1, args.num_query_groups // tp)
        if heads % cp:
            raise ConfigError(
                f"--cp-comm-type=a2a with --num-attention-heads={args.num_attention_heads}: {heads} heads per "
                f"tensor-parallel rank do not split over --context-parallel-size={cp}; use p2p or all_gather")
        if groups % cp and cp % groups:
            raise ConfigError(
                f"--cp-comm-type=a2a with --num-query-groups={args.num_query_groups}: {groups} query groups per "
                f"tensor-parallel rank neither split over nor repeat to --context-parallel-size={cp}; use p2p "
                "or all_gather")
    if "p2p" in types:
        masked = [(flag, value) for flag, value in (
            ("--window-size", args.window_size), ("--softmax-type", args.softmax_type != "vanilla"
                                                   and args.softmax_type),
            ("--reset-attention-mask", args.reset_attention_mask),
            ("--attention-dropout", args.attention_dropout or None)) if value]
        if masked:
            flag, value = masked[0]
            raise ConfigError(
                f"{flag}={value} with --cp-comm-type=p2p: ring attention runs the causal triangle only (its "
                "blocks are unmasked rectangles); all_gather or a2a express windows, sinks, document masks and "
                "attention dropout")
