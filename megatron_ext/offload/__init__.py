"""Chunked, race-free activation offload. See docs/offload.md and ``manager.py``.

Enabled by listing modules: ``--activation-offload-modules core_attention qkv_linear ...`` (recipe key
``activation_offload_modules``). Our flags are all ``--activation-offload-*``; megatron-core's own
offload (``--fine-grained-activation-offloading``, ``--offload-modules``, ``--activation-offload-fraction``)
is a different mechanism and cannot be combined with this one.
"""
from __future__ import annotations

from megatron_ext.config.typed import add_group
from megatron_ext.counters import SinceLastCall
from megatron_ext.errors import ConfigError
from megatron_ext.offload.manager import attach, current, detach
from megatron_ext.offload.vocabulary import ALIASES, MODULES, OffloadOptions, canonical_modules

__all__ = ["add_arguments", "validate", "after_model", "teardown", "attach", "detach", "current",
           "MODULES", "ALIASES", "OffloadOptions", "canonical_modules"]

# megatron-core recompute module names (--recompute-modules) -> ours they make pointless to offload
_RECOMPUTE_CONFLICTS = {
    "core_attn": ("core_attention",),
    "moe_act": ("moe_act",),
    "shared_experts": ("shared_experts",),
    "moe": ("router_fc1", "router_fc2", "moe_act", "shared_experts"),
}


# ours that live on the expert linears (hooked on linear_fc1 / linear_fc2 of the experts)
_EXPERT_LINEAR_MODULES = ("router_fc1", "router_fc2", "moe_act")


def add_arguments(parser):
    add_group(parser, OffloadOptions, "megatron_ext: activation offload")
    return parser


def validate(args) -> None:
    names = args.activation_offload_modules
    if not names:
        return
    if isinstance(names, str):
        names = names.split()
    bad = [n for n in names if ALIASES.get(n, n) not in MODULES]
    if bad:
        raise ConfigError(
            f"--activation-offload-modules={' '.join(names)}: unknown module {bad[0]!r}; valid: "
            f"{', '.join(MODULES)} (aliases {', '.join(ALIASES)})"
        )
    modules = canonical_modules(names)
    args.activation_offload_modules = list(modules)  # canonical from here on: OffloadOptions.from_args reads it
    options = OffloadOptions.from_args(args)  # each value inside its field's domain, or refused naming its flag
    if options.chunk_mb > options.pool_mb:
        raise ConfigError(f"--activation-offload-chunk-mb={options.chunk_mb}: larger than "
                          f"--activation-offload-pool-mb={options.pool_mb}")

    mods = " ".join(modules)
    if args.fine_grained_activation_offloading:
        raise ConfigError(
            "--fine-grained-activation-offloading=True: megatron-core's own activation offload installs "
            f"saved-tensor hooks on the same modules as --activation-offload-modules={mods}; use one of them"
        )
    if args.cuda_graph_impl not in (None, "none") or args.enable_cuda_graph or args.external_cuda_graph:
        raise ConfigError(
            f"--cuda-graph-impl={args.cuda_graph_impl}: a captured graph does not run the "
            f"Python hooks --activation-offload-modules={mods} relies on"
        )
    expert = [m for m in modules if m in _EXPERT_LINEAR_MODULES]
    if expert and args.use_transformer_engine_op_fuser:
        raise ConfigError(
            f"--use-transformer-engine-op-fuser=True: the experts run as one fused transformer-engine op that "
            f"never calls their linear_fc1/linear_fc2 (transformer/moe/experts.py:753), so "
            f"--activation-offload-modules {' '.join(expert)} would offload nothing; drop those modules or "
            "--use-transformer-engine-op-fuser"
        )
    granularity = args.recompute_granularity
    if granularity == "selective" or args.moe_layer_recompute:
        recomputed = list(args.recompute_modules or ["core_attn"])
        if args.moe_layer_recompute:
            recomputed.append("moe")
        for r in recomputed:
            clash = [m for m in _RECOMPUTE_CONFLICTS.get(r, ()) if m in modules]
            if clash:
                raise ConfigError(
                    f"--recompute-modules={' '.join(recomputed)}: {r!r} is recomputed, so {clash[0]} saves "
                    "nothing in forward (it runs without grad) and is re-run inside backward, where "
                    f"offloading cannot help; drop it from --activation-offload-modules={mods} or from "
                    "--recompute-modules"
                )
    if granularity == "full":
        method = args.recompute_method
        n = args.recompute_num_layers or 0
        vp = args.virtual_pipeline_model_parallel_size or 1
        per_chunk = args.num_layers // max(1, args.pipeline_model_parallel_size * vp)
        if method == "uniform" or n >= per_chunk:
            raise ConfigError(
                f"--recompute-granularity=full with --recompute-method={method} "
                f"--recompute-num-layers={n}: every layer is recomputed, so no layer saves anything to "
                f"offload; use --recompute-method=block with fewer than {per_chunk} layers, or drop "
                f"--activation-offload-modules={mods}"
            )


def after_model(args, model) -> None:
    if args.activation_offload_modules:
        manager = attach(model, OffloadOptions.from_args(args))
        if manager.pool.slots and manager.pool.slots[0].device.type == "cpu" and _rank() == 0:
            print("[offload] on CPU the host pool and the device are the same memory: offload moves the saved "
                  "bytes but cannot lower the process's RSS (on CUDA it lowers device memory)", flush=True)
    else:
        detach()


def summary(args) -> str:
    """The startup summary's line (training/features.py): the modules offloaded and the pool."""
    if not args.activation_offload_modules:
        return "offload: off (no --activation-offload-modules)"
    o = OffloadOptions.from_args(args)
    return (f"offload: {' '.join(o.modules)}; host pool {o.pool_mb:g} MiB in {o.chunk_mb:g} MiB chunks, tensors "
            f"from {o.min_tensor_kb:g} KiB, prefetch {o.prefetch_depth} layer(s), cross-pass {o.cross_pass_prefetch}")


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _why(reason: str, mib: float, options: OffloadOptions) -> str:
    return {
        "pool_full": f"{mib:.2f} MiB because the host pool was full (raise --activation-offload-pool-mb, "
                     f"now {options.pool_mb:g})",
        "small": f"{mib:.2f} MiB in tensors under the minimum (lower --activation-offload-min-tensor-kb, "
                 f"now {options.min_tensor_kb:g})",
        "last": f"{mib:.2f} MiB of the last layer before its backward, kept by design (offloading it cannot "
                "lower the peak: docs/offload.md)",
        "shared": f"{mib:.2f} MiB held by another tensor too (releasing it would free nothing)",
    }[reason]


def explain(manager) -> list[str]:
    """One line per listed module that kept on the device some of what it saved, for each reason the
    log has not given yet this run: how much, why, and the flag that changes it."""
    lines = []
    moved = manager.offloaded_by_module()
    for name in manager.options.modules:
        kept = manager.kept_by_module.get(name, {})
        new = [r for r, n in kept.items() if n and (name, r) not in manager.explained]
        if not new:
            continue
        manager.explained.update((name, r) for r in new)
        reasons = "; ".join(_why(r, kept[r] / 2**20, manager.options) for r in new)
        lines.append(f"{name} moved {moved.get(name, 0) / 2**20:.2f} MiB and kept on the device {reasons}")
    return lines


def at_log_line(args) -> None:
    """Every rank at a log line: why a listed module kept bytes on the device, once a run per module and
    reason, said by one rank of each pipeline stage (the first of its tensor and data parallel groups)."""
    manager = current()
    if manager is None:
        return
    lines = explain(manager)
    if not lines:
        return
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() or ps.get_data_parallel_rank(with_context_parallel=True):
        return
    stage = (f"pipeline stage {ps.get_pipeline_model_parallel_rank()}: "
             if ps.get_pipeline_model_parallel_world_size() > 1 else "")
    for line in lines:
        print(f"[offload] {stage}{line}", flush=True)


def teardown() -> None:
    """End of a run: no copy in flight and no copy-stream worker left; ``current()`` keeps the
    manager's counters readable until the next attach or detach."""
    manager = current()
    if manager is not None:
        manager.close()


_SINCE = SinceLastCall()


def log_counters() -> dict:
    """Activation bytes offloaded / kept on the device since the previous log line."""
    manager = current()
    if manager is None:
        return {}
    stats = dict(manager.stats)
    kept = sum(v for k, v in stats.items() if k.startswith("kept_"))
    # a new manager is a new run (persistent workers run several): counted from zero
    by_module = manager.offloaded_by_module()
    delta = _SINCE({"offloaded": stats["offloaded_bytes"], "kept": kept, **by_module}, run=manager)
    return {
        "act offloaded (MiB)": f"{delta['offloaded'] / 2**20:.2f}",
        # per module, so a module whose tensors bypass the hooks shows as 0
        "act offloaded by module (MiB)": " ".join(f"{m}={delta[m] / 2**20:.2f}" for m in manager.options.modules),
        "act kept on device (MiB)": f"{delta['kept'] / 2**20:.2f}",
    }
