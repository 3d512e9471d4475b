"""A configuration the planner chooses between, as the flags that set it.

``of_args`` reads a run's settings from its parsed (validated) arguments, normalised where megatron
derives or ignores a value: sequence parallelism is off under TP1, the CP comm type counts only
under context parallelism, expert sizes exist only with
experts, the recompute modules count only for selective recompute and the method and layer count
only for full, the offload's depth and pool only with offloaded modules. Two candidates are the same
configuration exactly when their settings are equal (``key``); a candidate's flags are the ones
whose setting differs from the run as given (``flags_between``), so the run's own configuration is
never a second candidate under another name.
"""
from __future__ import annotations

from megatron_ext.attention import comm_types

LAYOUT = ("--world-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
          "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
          "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
          "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--micro-batch-size", "--sequence-parallel",
          "--context-parallel-size", "--cp-comm-type")
RECOMPUTE = ("--recompute-granularity", "--recompute-modules", "--recompute-method", "--recompute-num-layers")
OFFLOAD = ("--activation-offload-modules", "--activation-offload-prefetch-depth", "--activation-offload-pool-mb")
ALL = (*LAYOUT, *RECOMPUTE, *OFFLOAD)


def dest(flag: str) -> str:
    """The argument's dest (and recipe key) of a flag."""
    return flag[2:].replace("-", "_")


def layout_of(args) -> dict:
    out = {flag: getattr(args, dest(flag)) for flag in LAYOUT}
    tp = args.tensor_model_parallel_size
    out["--sequence-parallel"] = bool(out["--sequence-parallel"]) and tp > 1  # megatron turns it off at TP1
    cp = out["--context-parallel-size"] = args.context_parallel_size or 1
    out["--cp-comm-type"] = tuple(comm_types(args)) if cp > 1 else None  # one value, or one per layer
    if args.num_experts:
        out["--expert-tensor-parallel-size"] = out["--expert-tensor-parallel-size"] or tp
    else:
        out["--expert-model-parallel-size"] = out["--expert-tensor-parallel-size"] = None
    return out


def recompute_of(args) -> dict:
    g = args.recompute_granularity
    g = g if g in ("selective", "full") else None
    return {"--recompute-granularity": g,
            "--recompute-modules": tuple(args.recompute_modules or ["core_attn"])
            if g == "selective" else None,
            "--recompute-method": args.recompute_method if g == "full" else None,
            "--recompute-num-layers": args.recompute_num_layers if g == "full" else None}


def recompute_choice(name: str) -> dict:
    """The search's recompute options as settings: none, selective (core attention), full (every
    layer, uniform)."""
    return {"--recompute-granularity": None if name == "none" else name,
            "--recompute-modules": ("core_attn",) if name == "selective" else None,
            "--recompute-method": "uniform" if name == "full" else None,
            "--recompute-num-layers": 1 if name == "full" else None}


def offload_of(args) -> dict:
    modules = args.activation_offload_modules
    on = bool(modules)
    return {"--activation-offload-modules": tuple(modules) if on else None,
            "--activation-offload-prefetch-depth": args.activation_offload_prefetch_depth if on else None,
            "--activation-offload-pool-mb": float(args.activation_offload_pool_mb) if on else None}


def offload_choice(modules: tuple, depth: int, pool_mb: float, given: dict) -> dict:
    """An offload of the search as settings. ``pool_mb``: the host pool it needs; the run's own pool
    is kept when it offloads the same modules as deep and its pool is large enough (the prediction
    is then the same)."""
    if not modules:
        return {flag: None for flag in OFFLOAD}
    out = {"--activation-offload-modules": tuple(modules), "--activation-offload-prefetch-depth": depth,
           "--activation-offload-pool-mb": float(pool_mb)}
    same = all(given[f] == out[f] for f in OFFLOAD[:2])
    if same and given["--activation-offload-pool-mb"] >= pool_mb:
        out["--activation-offload-pool-mb"] = given["--activation-offload-pool-mb"]
    return out


def of_args(args) -> dict:
    """The settings of a run as its validated arguments have them."""
    return {**layout_of(args), **recompute_of(args), **offload_of(args)}


def key(settings: dict) -> tuple:
    return tuple(settings[f] for f in ALL)


def changed(given: dict, settings: dict) -> list:
    return [f for f in ALL if settings[f] != given[f]]


def render(settings: dict, flags) -> list:
    """The command-line words that set ``flags`` to their values in ``settings``. A setting turned
    off (None / False) has no words: the command line cannot unset a value (see launch.py)."""
    out = []
    for f in flags:
        v = settings[f]
        if v is None or v is False:
            continue
        if v is True:
            out.append(f)
        elif isinstance(v, tuple):
            out += [f, *map(str, v)]
        else:
            out += [f, str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)]
    return out


def flags_between(given: dict, settings: dict) -> list:
    """The flags that turn the run as given into ``settings`` (what the candidate table prints)."""
    return render(settings, changed(given, settings))
