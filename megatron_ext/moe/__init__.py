"""Sync-free MoE token dispatch.

* :func:`indices_to_multihot` (``multihot.py``): top-k indices -> multihot routing map, pure torch,
  fixed shapes, no host-device sync, bit-identical to megatron-core's ``_indices_to_multihot``.
* :class:`MultihotTokenDispatcher` (``dispatcher.py``): replaces the alltoall / allgather token
  dispatcher of every megatron-core ``MoELayer``; zero syncs with a capacity factor, one (the
  variable split sizes) in dropless mode. Selected by ``--moe-sync-free-dispatcher`` (recipe key
  ``moe_sync_free_dispatcher: true``).
* :class:`SyncDetector` (``sync_detector.py``): counts the syncs a block would cause on CUDA, on CPU.

Importing this package does not import megatron-core; the hooks below do, when called.
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError
from megatron_ext.moe.multihot import indices_to_multihot

FLAG = "--moe-sync-free-dispatcher"

__all__ = ["indices_to_multihot", "add_arguments", "validate", "after_model", "install", "FLAG"]


def add_arguments(parser):
    group = parser.add_argument_group("megatron_ext: MoE token dispatch", "sync-free MoE token dispatch (docs/moe.md)")
    group.add_argument(
        FLAG,
        dest="moe_sync_free_dispatcher",
        action="store_true",
        default=False,
        help="Replace the token dispatcher of every MoE layer by megatron_ext's sync-free multihot "
        "dispatcher. It keeps the communication chosen by --moe-token-dispatcher-type (alltoall "
        "or allgather) and gives the same outputs; with --moe-expert-capacity-factor the MoE layer "
        "runs with no host-device synchronisation (CUDA-graph capturable), in dropless mode with "
        "exactly one (the variable split sizes). See docs/moe.md.",
    )
    return parser


def validate(args) -> None:
    if not getattr(args, "moe_sync_free_dispatcher", False):
        return
    on = f"{FLAG}=True"
    if not getattr(args, "num_experts", None):
        raise ConfigError(f"{on}: needs an MoE model (--num-experts is not set)")
    kind = getattr(args, "moe_token_dispatcher_type", "allgather")
    if kind not in ("alltoall", "allgather"):
        raise ConfigError(
            f"{on}: --moe-token-dispatcher-type={kind} is not supported (use alltoall or allgather)"
        )
    for flag, name in (
        ("--moe-permute-fusion", "moe_permute_fusion"),
        ("--moe-router-padding-for-quantization", "moe_router_padding_for_quantization"),
    ):
        if getattr(args, name, False):
            raise ConfigError(f"{on}: {flag} is not supported with the sync-free dispatcher")
    pad = getattr(args, "moe_pad_expert_input_to_capacity", False)
    if pad and getattr(args, "moe_expert_capacity_factor", None) is None:
        raise ConfigError(f"{on}: --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


installed = 0  # dispatchers replaced in this process (tests check the flag really took effect)


def install(model_chunks) -> int:
    """Swap the token dispatcher of every MoELayer in ``model_chunks`` (modules or DDP wrappers).
    Returns how many were replaced."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext import seams
    from megatron_ext.moe.dispatcher import MultihotTokenDispatcher

    def make(old):
        return old if isinstance(old, MultihotTokenDispatcher) else MultihotTokenDispatcher.replacing(old)

    global installed
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    replaced = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer) and seams.replace_token_dispatcher(module, make):
                replaced += 1
    installed += replaced
    return replaced


def after_model(args, model_chunks) -> None:
    if getattr(args, "moe_sync_free_dispatcher", False):
        install(model_chunks)
