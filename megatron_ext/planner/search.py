"""The search: for a memory budget, the offload modules, prefetch depth and recompute (and, asked for,
the TP/PP/VPP/EP/micro-batch split of the world size) that fit at the least predicted step time.

Options per layout: recompute none / selective (core attention) / full; offload: none, each module
alone and the modules in order of the bytes they remove (largest first, growing sets), each at
prefetch depth 1 and 2; combinations megatron_ext.offload refuses (a recomputed module offloaded,
offload under full recompute) are left out. A candidate fits when every stage's predicted peak is
within the budget; fitting candidates are ranked by predicted step time, the others by their peak.
"""
from __future__ import annotations

import dataclasses
import math
import sys

from megatron_ext.errors import ConfigError
from megatron_ext.planner import memory, steptime
from megatron_ext.planner import trace as tr
from megatron_ext.planner.run import recompute_of, target_config
from megatron_ext.planner.hardware import EFFICIENCY, GPUS

GIB = 2**30
RESERVE = 0.9  # of the GPU's memory: the rest for the allocator's fragmentation, NCCL and CUDA context
RECOMPUTE = ("none", "selective", "full")
_RECOMPUTED = {"selective": ("core_attention",)}  # offload modules a recompute makes pointless


@dataclasses.dataclass
class Candidate:
    flags: list
    fits: bool
    peak_bytes_per_stage: list
    step_time_s: float
    why: str = ""
    stages: list = dataclasses.field(default_factory=list)
    time: dict = dataclasses.field(default_factory=dict)
    layout: str = ""
    as_given: bool = False  # the run exactly as its flags say

    def as_json(self) -> dict:
        return dict(flags=self.flags, as_given=self.as_given, fits=self.fits, peak_bytes_per_stage=[round(p) for p in self.peak_bytes_per_stage],
                    step_time_s=self.step_time_s, why=self.why, layout=self.layout,
                    time={k: v for k, v in self.time.items() if k.endswith("_s")})


class Tracer:
    """Traces, cached by what changes them: per-rank widths (TP, expert TP) and recompute."""

    def __init__(self):
        self.cache: dict = {}

    def __call__(self, args, recompute: str | None) -> dict:
        """``recompute`` None: as the run has it (its own --recompute-modules)."""
        same = recompute == recompute_of(args) and (
            recompute != "selective" or list(getattr(args, "recompute_modules", None) or ["core_attn"]) == ["core_attn"])
        recompute = None if same else recompute
        key = (args.tensor_model_parallel_size, getattr(args, "expert_tensor_parallel_size", None), recompute,
               args.transformer_impl, tuple(getattr(args, "recompute_modules", None) or ()) if recompute is None else (),
               memory.fixed_budget_rows(args, args.expert_model_parallel_size, args.tensor_model_parallel_size))
        if key not in self.cache:
            self.cache[key] = tr.trace(args, recompute)
        return self.cache[key]


def _offload_sets(scaled, min_bytes: int, recompute: str) -> list:
    if recompute == "full":
        return [()]
    kinds = [scaled.kind(k) for k in scaled.kinds]
    size: dict = {}
    for c in kinds:
        for m, v in scaled.offloadable_at(c, min_bytes).items():
            size[m] = max(size.get(m, 0.0), v)
    order = [m for m in sorted(size, key=lambda m: -size[m]) if m not in _RECOMPUTED.get(recompute, ())]
    sets = [()] + [(m,) for m in order] + [tuple(order[:i]) for i in range(2, len(order) + 1)]
    return list(dict.fromkeys(sets))


def _layout_flags(args) -> list:
    f = ["--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
         "--pipeline-model-parallel-size", str(args.pipeline_model_parallel_size)]
    if args.virtual_pipeline_model_parallel_size:
        per = args.num_layers // (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
        f += ["--num-layers-per-virtual-pipeline-stage", str(per)]
    if args.num_experts:
        f += ["--expert-model-parallel-size", str(args.expert_model_parallel_size)]
    f += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.tensor_model_parallel_size > 1 and args.sequence_parallel:
        f.append("--sequence-parallel")
    return f


def _flags(args, recompute: str, off: memory.Offload, pool_bytes: float, layout_search: bool) -> tuple:
    flags, notes = (_layout_flags(args) if layout_search else []), []
    if recompute == "selective":
        flags += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    elif recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif recompute_of(args) != "none":
        notes.append("recompute off (drop recompute_granularity)")
    if off.modules:
        flags += ["--activation-offload-modules", *off.modules,
                  "--activation-offload-prefetch-depth", str(off.prefetch_depth),
                  "--activation-offload-pool-mb", str(max(64, math.ceil(pool_bytes * 1.25 / 2**20)))]
    elif getattr(args, "activation_offload_modules", None):
        notes.append("offload off (drop activation_offload_modules)")
    return flags, notes


def _reparse(args, flags: list, drop_uneven: bool, parse_run):
    """The run's flags with a layout's, validated again by ``parse_run`` (megatron derives values
    from the sizes); None when refused (the reason on stderr)."""
    argv = list(getattr(args, "plan_argv", None) or [])
    if drop_uneven:  # first/last stage layer counts belong to the recipe's pipeline size
        flags = [*flags, "--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "0"] \
            if getattr(args, "decoder_first_pipeline_num_layers", None) else flags
    try:
        a = parse_run([*argv, *flags])
    except (ConfigError, ValueError, AssertionError) as e:
        print(f"planner: {' '.join(flags)} refused: {str(e).splitlines()[-1][:200]}", file=sys.stderr)
        return None
    a.plan_argv = argv
    return a


def layouts(args, parse_run) -> list:
    """Parallel splits of the run's world size that megatron accepts (same global batch), each
    validated as --dry-run does."""
    out = []
    world, layers = args.world_size, args.num_layers
    heads = args.num_attention_heads
    groups = (args.num_query_groups or heads) if getattr(args, "group_query_attention", False) else heads
    experts = args.num_experts or 0
    for tp in (1, 2, 4, 8):
        if heads % tp or groups % tp or world % tp or (args.ffn_hidden_size or 0) % tp:
            continue
        for pp in (1, 2, 4, 8, 16, 32):
            if world % (tp * pp) or layers % pp:
                continue
            dp = world // (tp * pp)
            for vpp in (None, 2, 4):
                if vpp and (pp == 1 or layers % (pp * vpp)):
                    continue
                for ep in ([1] if not experts else [e for e in (1, 2, 4, 8, 16, 32, 64) if experts % e == 0]):
                    if (world // pp) % (ep * tp if experts else 1):
                        continue
                    for mbs in (1, 2):
                        if args.global_batch_size % (mbs * dp):
                            continue
                        m = args.global_batch_size // (mbs * dp)
                        if vpp and m % pp:
                            continue
                        flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                                 "--micro-batch-size", str(mbs), "--world-size", str(world)]
                        if vpp:
                            flags += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vpp))]
                        if experts:
                            flags += ["--expert-model-parallel-size", str(ep), "--expert-tensor-parallel-size", "1"]
                        if tp > 1:
                            flags.append("--sequence-parallel")
                        a = _reparse(args, flags, pp != args.pipeline_model_parallel_size, parse_run)
                        if a is None:
                            continue
                        out.append(a)
    return out


def _group_bytes(scaled, stages: list, off: memory.Offload) -> list:
    """Per stage, the bytes one layer's offloaded group copies per micro-batch."""
    return [max((sum(v for m, v in scaled.offloadable_at(scaled.kind(k), off.min_tensor_bytes).items()
                     if m in off.modules)
                 for k in {x for ch in s["layers"] for x in ch} if k in scaled.kinds), default=0.0) for s in stages]


def _why(peaks: list, budget: float) -> tuple:
    worst = max(range(len(peaks)), key=lambda i: peaks[i])
    fits = peaks[worst] <= budget
    return fits, (f"fits: stage {worst} peaks at {peaks[worst] / GIB:.1f} GiB <= {budget / GIB:.1f} GiB"
                  if fits else f"stage {worst} needs {peaks[worst] / GIB:.1f} GiB > {budget / GIB:.1f} GiB")


def _evaluate(args, layout_search: bool, tracer: Tracer, budget: float, gpu: dict, link: float,
              efficiency: float, recomputes=RECOMPUTE) -> list:
    config = target_config(args)
    layout = memory.Layout.from_args(args)
    base = memory.Offload.from_args(args)
    min_bytes = base.min_tensor_bytes if base.modules else memory.Offload().min_tensor_bytes
    out = []
    for recompute in recomputes:
        traced = tracer(args, recompute)
        scaled = tr.scaled(args, traced)
        for mods in _offload_sets(scaled, min_bytes, recompute):
            for depth in ((1, 2) if mods else (1,)):
                off = memory.Offload(mods, depth, min_bytes)
                stages = memory.predict(args, config, scaled, off)
                group = _group_bytes(scaled, stages, off)
                t = steptime.step_time(args, layout, stages, group, gpu, efficiency, link, recompute)
                peaks = [s["peak_bytes"] for s in stages]
                pool = max(-s["components"]["offload_removed"] for s in stages)
                flags, notes = _flags(args, recompute, off, pool, layout_search)
                fits, why = _why(peaks, budget)
                if t["offload_exposed_s"] > 0:
                    why += f"; the host link cannot hide {t['offload_exposed_s']:.2f} s of copies"
                if notes:
                    why += "; " + ", ".join(notes)
                out.append(Candidate(flags, fits, peaks, t["step_time_s"], why, stages, t, layout.describe()))
    return out


def plan(args, gpu: str = "h100", memory_gb: float | None = None, host_link_gbps: float | None = None,
         search_parallelism: bool = False, top: int = 5, efficiency: float = EFFICIENCY,
         flag_prefix: str = "--", recomputes=RECOMPUTE, tracer: Tracer | None = None, reparse=None,
         refuse: bool = True) -> dict:
    """{"stages": the run as given, per stage, "candidates": best first, "budget_bytes", ...}.
    Raises ConfigError naming the flag for an unknown GPU or a budget nothing meets. ``reparse``
    (argv -> parsed arguments) validates the layouts of ``search_parallelism``."""
    if gpu not in GPUS:
        raise ConfigError(f"{flag_prefix}gpu={gpu}: unknown GPU; known: {', '.join(sorted(GPUS))}")
    g = GPUS[gpu]
    budget = memory_gb * GIB if memory_gb else g["memory_gib"] * GIB * RESERVE
    link = host_link_gbps * 1e9 if host_link_gbps else g["host_link"]
    tracer = tracer or Tracer()
    given = tracer(args, None)  # the run as given
    layout = memory.Layout.from_args(args)
    scaled = tr.scaled(args, given)
    as_given = memory.predict(args, target_config(args), scaled)
    off = memory.Offload.from_args(args)
    t = steptime.step_time(args, layout, as_given, _group_bytes(scaled, as_given, off), g, efficiency, link,
                           recompute_of(args))
    peaks = [s["peak_bytes"] for s in as_given]
    fits, why = _why(peaks, budget)
    given_candidate = Candidate([], fits, peaks, t["step_time_s"], "as given: " + why, as_given, t,
                                layout.describe(), as_given=True)
    candidates = []
    for a in (layouts(args, reparse) if search_parallelism else [args]):
        try:
            candidates += _evaluate(a, search_parallelism, tracer, budget, g, link, efficiency, recomputes)
        except (ValueError, AssertionError, RuntimeError) as e:  # a split megatron refuses
            print(f"planner: {memory.Layout.from_args(a).describe()} skipped: {str(e).splitlines()[-1][:200]}",
                  file=sys.stderr)
            continue
    candidates.sort(key=lambda c: (not c.fits, c.step_time_s if c.fits else max(c.peak_bytes_per_stage), len(c.flags)))
    # the run as given first when it fits: nothing to change, no recompute or offload it does not need
    candidates = [given_candidate, *candidates] if fits else [*candidates, given_candidate]
    seen, unique = set(), []
    for c in candidates:
        key = (c.as_given, tuple(c.flags), c.why.split("; ", 1)[-1] if not c.as_given else "")
        if key not in seen:
            seen.add(key)
            unique.append(c)
    unique.sort(key=lambda c: not c.fits)  # stable: the fitting ones, in the order above
    if refuse and (not unique or not unique[0].fits):
        closest = unique[0] if unique else None
        what = (f"; closest: {' '.join(closest.flags) or 'as given'} ({closest.layout}) needs "
                f"{max(closest.peak_bytes_per_stage) / GIB:.1f} GiB" if closest else "")
        given_flag = f"{flag_prefix}memory-gb={memory_gb}" if memory_gb else f"{flag_prefix}gpu={gpu}"
        raise ConfigError(f"{given_flag}: no configuration fits {budget / GIB:.1f} GiB per GPU{what}")
    return dict(gpu=gpu, budget_bytes=budget, host_link_bytes_per_s=link, efficiency=efficiency,
                layout=layout.describe(), stages=as_given, candidates=unique[:top], all_candidates=len(unique),
                as_given=given_candidate,
                trace_divisor=given["divisor"])
