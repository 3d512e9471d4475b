"""Chunked, race-free activation offload. See docs/offload.md and ``manager.py``.

Enabled by listing modules: ``--activation-offload-modules core_attention qkv_linear ...`` (recipe key
``activation_offload_modules``). Our flags are all ``--activation-offload-*``; megatron-core's own
offload (``--fine-grained-activation-offloading``, ``--offload-modules``, ``--activation-offload-fraction``)
is a different mechanism and cannot be combined with this one.
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError
from megatron_ext.offload.manager import attach, current, detach
from megatron_ext.offload.vocabulary import ALIASES, MODULES, Options, canonical_modules
from megatron_ext.counters import SinceLastCall

__all__ = ["add_arguments", "validate", "after_model", "teardown", "options_from_args", "attach", "detach", "current",
           "MODULES", "ALIASES", "Options"]

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
    g = parser.add_argument_group("megatron_ext: activation offload", "chunked, race-free activation offload "
                                  "(docs/offload.md)")
    g.add_argument(
        "--activation-offload-modules", nargs="+", default=None, metavar="MODULE",
        help="Offload to host memory what these modules save for backward, and bring it back before "
        f"backward needs it. Any of: {', '.join(MODULES)} (aliases: "
        f"{', '.join(f'{k}={v}' for k, v in ALIASES.items())}). Not given: offload is off.",
    )
    g.add_argument("--activation-offload-pool-mb", type=float, default=1024.0,
                   help="Size of the host pool (pinned on CUDA) that offloaded bytes live in. When it is "
                   "full a tensor stays on the device.")
    g.add_argument("--activation-offload-chunk-mb", type=float, default=4.0,
                   help="Copies move in chunks of this size (one pool slot each).")
    g.add_argument("--activation-offload-prefetch-depth", type=int, default=1,
                   help="In backward, reload this many layers ahead of the one being computed.")
    g.add_argument("--activation-offload-cross-pass-prefetch", choices=("off", "after-forward", "always"),
                   default="after-forward",
                   help="Also prefetch the last layers of the micro-batch predicted (from the previous step's "
                   "observed order) to run backward next: after-forward = when a chunk's forward returns "
                   "and a backward comes next (overlaps the pipeline wait; no extra peak measured); always = "
                   "also at the end of a micro-batch's backward when another backward follows (one more "
                   "layer resident at non-last stages' peak).")
    g.add_argument("--activation-offload-min-tensor-kb", type=float, default=64.0,
                   help="Saved tensors (storages) smaller than this stay on the device.")
    g.add_argument("--activation-offload-debug", action="store_true",
                   help="Poison released device storage, free pool slots and unfilled reload buffers with "
                   "NaN bytes (released storage is also resized to 0); on CPU run the copy streams as "
                   "deferred queues, so a missing wait or early release fails loudly.")
    return parser


def validate(args) -> None:
    names = getattr(args, "activation_offload_modules", None)
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
    args.activation_offload_modules = list(modules)  # canonical from here on: options_from_args reads it

    pool, chunk = args.activation_offload_pool_mb, args.activation_offload_chunk_mb
    if not pool > 0:
        raise ConfigError(f"--activation-offload-pool-mb={pool}: must be > 0")
    if not chunk > 0:
        raise ConfigError(f"--activation-offload-chunk-mb={chunk}: must be > 0")
    if chunk > pool:
        raise ConfigError(f"--activation-offload-chunk-mb={chunk}: larger than --activation-offload-pool-mb={pool}")
    if args.activation_offload_prefetch_depth < 0:
        raise ConfigError(f"--activation-offload-prefetch-depth={args.activation_offload_prefetch_depth}: must be >= 0")
    if args.activation_offload_min_tensor_kb < 0:
        raise ConfigError(f"--activation-offload-min-tensor-kb={args.activation_offload_min_tensor_kb}: must be >= 0")

    mods = " ".join(modules)
    if getattr(args, "fine_grained_activation_offloading", False):
        raise ConfigError(
            "--fine-grained-activation-offloading=True: megatron-core's own activation offload installs "
            f"saved-tensor hooks on the same modules as --activation-offload-modules={mods}; use one of them"
        )
    if getattr(args, "cpu_offloading", False):
        raise ConfigError(f"--cpu-offloading=True: transformer-engine's layer offload cannot be combined with "
                          f"--activation-offload-modules={mods}")
    if getattr(args, "cuda_graph_impl", "none") not in (None, "none") or getattr(args, "enable_cuda_graph", False) \
            or getattr(args, "external_cuda_graph", False):
        raise ConfigError(
            f"--cuda-graph-impl={getattr(args, 'cuda_graph_impl', None)}: a captured graph does not run the "
            f"Python hooks --activation-offload-modules={mods} relies on"
        )
    expert = [m for m in modules if m in _EXPERT_LINEAR_MODULES]
    if expert and getattr(args, "use_transformer_engine_op_fuser", False):
        raise ConfigError(
            f"--use-transformer-engine-op-fuser=True: the experts run as one fused transformer-engine op that "
            f"never calls their linear_fc1/linear_fc2 (transformer/moe/experts.py:753), so "
            f"--activation-offload-modules {' '.join(expert)} would offload nothing; drop those modules or "
            "--use-transformer-engine-op-fuser"
        )
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "selective" or getattr(args, "moe_layer_recompute", False):
        recomputed = list(getattr(args, "recompute_modules", None) or ["core_attn"])
        if getattr(args, "moe_layer_recompute", False):
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
        method = getattr(args, "recompute_method", None)
        n = getattr(args, "recompute_num_layers", None) or 0
        vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        per_chunk = args.num_layers // max(1, getattr(args, "pipeline_model_parallel_size", 1) * vp)
        if method == "uniform" or n >= per_chunk:
            raise ConfigError(
                f"--recompute-granularity=full with --recompute-method={method} "
                f"--recompute-num-layers={n}: every layer is recomputed, so no layer saves anything to "
                f"offload; use --recompute-method=block with fewer than {per_chunk} layers, or drop "
                f"--activation-offload-modules={mods}"
            )


def options_from_args(args) -> Options:
    """The options of a validated run (``validate`` left the module names canonical)."""
    return Options(
        modules=tuple(args.activation_offload_modules),  # canonicalised by validate
        pool_bytes=int(args.activation_offload_pool_mb * (1 << 20)),
        chunk_bytes=max(1, int(args.activation_offload_chunk_mb * (1 << 20))),
        prefetch_depth=args.activation_offload_prefetch_depth,
        min_tensor_bytes=int(args.activation_offload_min_tensor_kb * 1024),
        debug=bool(args.activation_offload_debug),
        cross_pass_prefetch=getattr(args, "activation_offload_cross_pass_prefetch", "after-forward"),
    )


def after_model(args, model) -> None:
    if getattr(args, "activation_offload_modules", None):
        attach(model, options_from_args(args))
    else:
        detach()


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
