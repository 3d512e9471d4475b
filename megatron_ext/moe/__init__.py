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

from megatron_ext.config.typed import add_group
from megatron_ext.errors import ConfigError
from megatron_ext.moe.multihot import indices_to_multihot
from megatron_ext.moe.options import MoEOptions

FLAG = "--moe-sync-free-dispatcher"
ZERO_SYNC = "--moe-zero-sync-dropless"
BUDGET = "--moe-dropless-budget-factor"
OVERFLOW_FLAG = "--moe-dropless-overflow"

__all__ = ["indices_to_multihot", "MoEOptions", "add_arguments", "before_validate", "validate", "before_model",
           "after_model", "install", "size_buffers", "at_log_line", "log_counters", "teardown", "FLAG"]


def add_arguments(parser):
    add_group(parser, MoEOptions, "megatron_ext: MoE token dispatch", "sync-free MoE token dispatch (docs/moe.md)")
    return parser


def before_validate(args) -> None:
    from megatron_ext.moe import graphs

    graphs.before_validate(args, ZERO_SYNC)


def validate(args) -> None:
    opts = MoEOptions.from_args(args)
    _validate_zero_sync(args, opts)
    if not opts.sync_free_dispatcher:
        return
    on = f"{FLAG}=True"
    if not args.num_experts:
        raise ConfigError(f"{on}: needs an MoE model (--num-experts is not set)")
    kind = args.moe_token_dispatcher_type
    if kind not in ("alltoall", "allgather"):
        raise ConfigError(
            f"{on}: --moe-token-dispatcher-type={kind} is not supported (use alltoall or allgather)"
        )
    for flag, value in (
        ("--moe-permute-fusion", args.moe_permute_fusion),
        ("--moe-router-padding-for-quantization", args.moe_router_padding_for_quantization),
    ):
        if value:
            raise ConfigError(f"{on}: {flag} is not supported with the sync-free dispatcher")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        raise ConfigError(f"{on}: --moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


def _validate_zero_sync(args, opts: MoEOptions) -> None:
    factor = opts.dropless_budget_factor
    if not opts.zero_sync_dropless:
        if factor is not None:
            raise ConfigError(f"{BUDGET}={factor}: needs {ZERO_SYNC}")
        return
    on = f"{ZERO_SYNC}=True"
    if not opts.sync_free_dispatcher:
        raise ConfigError(f"{on}: needs {FLAG}")
    if args.moe_expert_capacity_factor is not None:
        raise ConfigError(f"{on}: is the dropless mode; --moe-expert-capacity-factor="
                          f"{args.moe_expert_capacity_factor} already has no host sync")
    if args.moe_grouped_gemm:
        raise ConfigError(f"{on}: --moe-grouped-gemm runs transformer-engine's grouped GEMM, which takes "
                          "per-expert row counts on the host; the grouped experts here need the local "
                          "SequentialMLP experts (drop --moe-grouped-gemm)")
    for flag, value in (("--fp8-format", args.fp8), ("--fp4-format", args.fp4)):
        if flag == "--fp8-format" and args.transformer_impl == "local":
            continue  # torchao's FP8 products (megatron_ext/fp8): checked there
        if value:
            raise ConfigError(f"{on}: {flag} pads expert inputs per expert on the host; not supported")
    if args.use_te_activation_func:
        raise ConfigError(f"{on}: --use-te-activation-func is not supported by the grouped experts")
    if args.moe_latent_size:
        raise ConfigError(f"{on}: --moe-latent-size is not supported by the grouped experts")
    check_grouped_gemm_platform(args, on)
    dtype_bytes = 2 if (args.bf16 or args.fp16) else 4
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    etp = args.expert_tensor_parallel_size or 1
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
    if not args.bf16:
        precision = "--fp16" if args.fp16 else "fp32 (no --bf16)"
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


def size_buffers(model_chunks, rows_per_token: float) -> int:
    """Size every fixed-budget dispatcher's buffers at ``rows_per_token`` rows per token, not by the
    budget factor (the planner's tiny trace, one rank, sizes them as the run it models does). Returns
    how many dispatchers it sized."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_ext.moe.fixed_dispatch import FixedBudgetDispatcher

    sized = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer) and isinstance(module.token_dispatcher, FixedBudgetDispatcher):
                module.token_dispatcher.rows_per_token = rows_per_token
                sized += 1
    return sized


def before_model(args, config) -> None:
    from megatron_ext.moe import graphs

    graphs.before_model(args, config)


def after_model(args, model_chunks) -> None:
    from megatron_ext.moe import graphs

    opts = MoEOptions.from_args(args)
    if opts.sync_free_dispatcher:
        install(model_chunks, zero_sync=opts.zero_sync_dropless, budget_factor=opts.dropless_budget_factor,
                cuda_graphs=graphs.capturing(args))


_last_line = {}  # this process's overflow figures of the last log line (zero-sync mode only)


def at_log_line(args) -> None:
    """Every rank, at each log line: the one host read of the overflow counters, summed (pairs
    dropped) and maxed (load) over the ranks, so every rank decides the same."""
    opts = MoEOptions.from_args(args)
    if not opts.zero_sync_dropless:
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
    if n and opts.dropless_overflow == "error":
        raise ConfigError(f"{BUDGET}={opts.dropless_budget_factor}: {n} routed (token, expert) pairs "
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


def summary(args) -> str:
    """The startup summary's line (training/features.py): the token dispatcher and the dropless mode."""
    if not args.num_experts:
        return "moe: off (a dense model: no --num-experts)"
    kind = args.moe_token_dispatcher_type
    dispatcher = f"sync-free multihot ({FLAG}, {kind} communication)" if args.moe_sync_free_dispatcher else \
        f"megatron's {kind}"
    if args.moe_expert_capacity_factor is not None:
        dropping = f"capacity factor {args.moe_expert_capacity_factor:g} (tokens past it dropped)"
    elif args.moe_zero_sync_dropless:
        budget = "the worst case" if args.moe_dropless_budget_factor is None else \
            f"{args.moe_dropless_budget_factor:g} x the balanced load"
        dropping = f"dropless, zero-sync ({ZERO_SYNC}: budget {budget}, overflow {args.moe_dropless_overflow})"
    else:
        dropping = "dropless (megatron's: the split sizes read on the host in each layer)"
    return f"moe: {args.num_experts} experts, top-{args.moe_router_topk}; dispatcher {dispatcher}; {dropping}"
