"""Sync-free MoE token dispatch.

* :func:`indices_to_multihot` (``multihot.py``): top-k indices -> multihot routing map, pure torch,
  fixed shapes, no host-device sync, bit-identical to megatron-core's ``_indices_to_multihot``.
* :class:`MultihotTokenDispatcher` (``dispatcher.py``): replaces the alltoall / allgather token
  dispatcher of every megatron-core ``MoELayer``; zero syncs with a capacity factor, one (the
  variable split sizes) in dropless mode. Selected by ``--moe-sync-free-dispatcher`` (recipe key
  ``moe_sync_free_dispatcher: true``).
* :class:`FixedBudgetDispatcher` (``fixed_dispatch.py``) with grouped experts over device offsets
  (``grouped_experts.py``): dropless with zero syncs, ``--moe-zero-sync-dropless``; a token budget
  (``--moe-dropless-budget-factor``) whose overflow is counted on the device and read at log time
  (``--moe-dropless-overflow``).
* :class:`SyncDetector` (``sync_detector.py``): counts the syncs a block would cause on CUDA, on CPU
  (host reads, host tensors in device ops, dtype-dependent syncs); ``audit.py`` runs it on one MoE layer.
* ``graphs.py``: ``--cuda-graph-impl local --cuda-graph-modules moe`` with ``--moe-zero-sync-dropless``
  captures every MoE layer in a CUDA graph (megatron's graph manager bound to the layer's forward).

Importing this package does not import megatron-core; the hooks below do, when called.
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError
from megatron_ext.moe.multihot import indices_to_multihot

FLAG = "--moe-sync-free-dispatcher"
ZERO_SYNC = "--moe-zero-sync-dropless"
BUDGET = "--moe-dropless-budget-factor"
OVERFLOW_FLAG = "--moe-dropless-overflow"

__all__ = ["indices_to_multihot", "add_arguments", "before_validate", "validate", "before_model", "after_model",
           "install", "at_log_line", "log_counters", "teardown", "FLAG"]


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
    group.add_argument(
        ZERO_SYNC,
        dest="moe_zero_sync_dropless",
        action="store_true",
        default=False,
        help=f"With {FLAG} in dropless mode: no host synchronisation at all. Tokens travel in "
        "fixed-size per-rank buffers (a token budget), the experts run as grouped GEMMs over "
        "per-expert offsets kept on the device (local spec experts). Bit-identical to megatron's "
        "dropless dispatcher while nothing overflows the budget.",
    )
    group.add_argument(
        BUDGET,
        dest="moe_dropless_budget_factor",
        type=float,
        default=None,
        help=f"With {ZERO_SYNC}: rows of each buffer as a multiple of the balanced load "
        "(tokens x top-k / EP), capped at the worst case. Default: the worst case "
        "(tokens x min(top-k, local experts)), where nothing can overflow.",
    )
    group.add_argument(
        OVERFLOW_FLAG,
        dest="moe_dropless_overflow",
        choices=("error", "drop"),
        default="error",
        help=f"With {ZERO_SYNC} and a budget below the worst case: what a routing that overflows "
        "it does. error: stop at the next log line, naming the factor that would have fitted; "
        "drop: drop the pairs past the budget, counted in the log line. (default: error)",
    )
    return parser


def before_validate(args) -> None:
    from megatron_ext.moe import graphs

    graphs.before_validate(args, ZERO_SYNC)


def validate(args) -> None:
    _validate_zero_sync(args)
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


def _validate_zero_sync(args) -> None:
    factor = getattr(args, "moe_dropless_budget_factor", None)
    zero_sync = getattr(args, "moe_zero_sync_dropless", False)
    if not zero_sync:
        if factor is not None:
            raise ConfigError(f"{BUDGET}={factor}: needs {ZERO_SYNC}")
        return
    on = f"{ZERO_SYNC}=True"
    if not getattr(args, "moe_sync_free_dispatcher", False):
        raise ConfigError(f"{on}: needs {FLAG}")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        raise ConfigError(f"{on}: is the dropless mode; --moe-expert-capacity-factor="
                          f"{args.moe_expert_capacity_factor} already has no host sync")
    if factor is not None and not factor > 0:
        raise ConfigError(f"{BUDGET}={factor}: must be > 0")
    if getattr(args, "moe_grouped_gemm", False):
        raise ConfigError(f"{on}: --moe-grouped-gemm runs transformer-engine's grouped GEMM, which takes "
                          "per-expert row counts on the host; the grouped experts here need the local "
                          "SequentialMLP experts (drop --moe-grouped-gemm)")
    for flag, name in (("--fp8-format", "fp8"), ("--fp4-format", "fp4")):
        if name == "fp8" and args.transformer_impl == "local":
            continue  # torchao's FP8 products (megatron_ext/fp8): checked there
        if getattr(args, name, None):
            raise ConfigError(f"{on}: {flag} pads expert inputs per expert on the host; not supported")
    if getattr(args, "use_te_activation_func", False):
        raise ConfigError(f"{on}: --use-te-activation-func is not supported by the grouped experts")
    if getattr(args, "moe_latent_size", None):
        raise ConfigError(f"{on}: --moe-latent-size is not supported by the grouped experts")
    check_grouped_gemm_platform(args, on)
    dtype_bytes = 2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4
    ffn = getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None)
    etp = getattr(args, "expert_tensor_parallel_size", None) or 1
    for name, size in (("--hidden-size", args.hidden_size), ("--moe-ffn-hidden-size / expert-TP", (ffn or 0) // etp)):
        if size and (size * dtype_bytes) % 16:
            raise ConfigError(f"{on}: {name}={size}: the grouped GEMM needs rows of a multiple of 16 bytes "
                              f"({16 // dtype_bytes} elements in this precision)")


def check_grouped_gemm_platform(args, on: str) -> None:
    """On CUDA the zero-sync experts need torch's grouped-GEMM kernel, which exists for bf16 on compute
    capability 9.x/10.x only; elsewhere torch's fallback copies the offsets to the host (2 syncs forward
    and 4 backward per layer, measured on an H200 in fp32) and CUDA-graph capture fails. A padded batched
    GEMM would avoid the read at (local experts)x the FLOPs and memory (docs/moe.md): refused instead."""
    from megatron_ext.moe.sync_detector import GROUPED_GEMM_ARCHS
    from megatron_ext.platform.target import resolve

    target = resolve(args)
    if not target.cuda:
        return  # CPU: every op is on the host anyway (the audit models CUDA: megatron_ext/moe/audit.py)
    if not getattr(args, "bf16", False):
        precision = "--fp16" if getattr(args, "fp16", False) else "fp32 (no --bf16)"
        raise ConfigError(f"{on} with {precision}: on CUDA the grouped GEMM (torch._grouped_mm) reads its expert "
                          "offsets on the host except in bf16 (2 syncs forward, 4 backward per layer): add --bf16, "
                          "or use --moe-expert-capacity-factor (capacity mode has no sync in any precision)")
    if target.declared:
        arch = target.arch
        gpu = f"--target-gpu={target.gpu}"
    else:
        import torch

        capability = torch.cuda.get_device_capability()
        arch = capability[0]
        gpu = f"this GPU ({torch.cuda.get_device_name()}, compute capability {'.'.join(map(str, capability))})"
    if arch not in GROUPED_GEMM_ARCHS:
        raise ConfigError(f"{on} on {gpu}: torch's bf16 grouped-GEMM kernel needs compute capability 9.x or "
                          "10.x (Hopper, Blackwell); elsewhere it reads its expert offsets on the host; use "
                          "--moe-expert-capacity-factor, or the one-sync dropless mode (drop this flag)")


installed = 0  # dispatchers replaced in this process (tests check the flag really took effect)


def install(model_chunks, zero_sync: bool = False, budget_factor=None, cuda_graphs: bool = False,
            grouped=None) -> int:
    """Swap the token dispatcher of every MoELayer in ``model_chunks`` (modules or DDP wrappers);
    with ``zero_sync`` the fixed-budget one, and the experts run grouped over device offsets
    (``grouped``: the module providing ``attach``, grouped_experts by default); with ``cuda_graphs``
    each layer's forward is captured (graphs.py). Returns how many were replaced."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext import seams
    from megatron_ext.moe import graphs, grouped_experts
    from megatron_ext.moe.dispatcher import MultihotTokenDispatcher
    from megatron_ext.moe.fixed_dispatch import FixedBudgetDispatcher

    kind = FixedBudgetDispatcher if zero_sync else MultihotTokenDispatcher

    def make(old):
        if type(old) is kind:
            return old
        if zero_sync:
            return FixedBudgetDispatcher.replacing(old, budget_factor=budget_factor)
        return MultihotTokenDispatcher.replacing(old)

    global installed
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    replaced = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer) and seams.replace_token_dispatcher(module, make):
                replaced += 1
                if zero_sync:
                    seams.run_experts_grouped(module, (grouped or grouped_experts).attach)
                if cuda_graphs:
                    graphs.capture(module)
    installed += replaced
    return replaced


def before_model(args, config) -> None:
    from megatron_ext.moe import graphs

    graphs.before_model(args, config)


def after_model(args, model_chunks) -> None:
    from megatron_ext.moe import graphs

    if getattr(args, "moe_sync_free_dispatcher", False):
        install(model_chunks, zero_sync=getattr(args, "moe_zero_sync_dropless", False),
                budget_factor=getattr(args, "moe_dropless_budget_factor", None), cuda_graphs=graphs.capturing(args))


_last_line = {}  # this process's overflow figures of the last log line (zero-sync mode only)


def at_log_line(args) -> None:
    """Every rank, at each log line: the one host read of the overflow counters, summed (pairs
    dropped) and maxed (load) over the ranks, so every rank decides the same."""
    if not getattr(args, "moe_zero_sync_dropless", False):
        return
    import math

    import torch

    from megatron_ext import platform
    from megatron_ext.moe.fixed_dispatch import OVERFLOW as counter

    dropped, load = counter.take()  # device tensors, or None before the first dispatch
    device = platform.current().device
    dropped = torch.zeros(1, dtype=torch.float64, device=device) if dropped is None else dropped.double()
    load = torch.zeros(1, dtype=torch.float64, device=device) if load is None else load
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(dropped)
        torch.distributed.all_reduce(load, op=torch.distributed.ReduceOp.MAX)
    n, fits = int(dropped.item()), math.ceil(load.item() * 100) / 100
    _last_line.update(dropped=n)
    if n and args.moe_dropless_overflow == "error":
        raise ConfigError(f"{BUDGET}={args.moe_dropless_budget_factor}: {n} routed (token, expert) pairs "
                          f"overflowed the dispatch budget since the last log line; a factor of {fits} "
                          f"would have fitted (or {OVERFLOW_FLAG} drop to drop them)")


def log_counters() -> dict:
    if not _last_line:
        return {}
    return {"moe dropped pairs": _last_line.pop("dropped")}


def teardown() -> None:
    from megatron_ext.moe import graphs
    from megatron_ext.moe.fixed_dispatch import OVERFLOW as counter

    counter.reset()
    _last_line.clear()
    graphs.teardown()
