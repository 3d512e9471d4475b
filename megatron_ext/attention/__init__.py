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
    if getattr(args, "context_parallel_size", 1) > 1:
        raise ConfigError(
            f"--context-parallel-size={args.context_parallel_size} with --transformer-impl=local: the local "
            f"spec's core attention ({_LOCAL_SPEC[chosen]}) attends the whole sequence on one rank "
            "(megatron's DotProductAttention asserts it, transformer/dot_product_attention.py:58); context "
            "parallelism needs transformer-engine's attention")
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
    return f"attention: {chosen} ({why})"
