"""The search: for a memory budget, the offload modules, prefetch depth and recompute (and, asked for,
the TP/PP/VPP/EP/micro-batch split of the world size) that fit at the least predicted step time.

Options per layout: recompute none / selective (core attention) / full; offload: none, each module
alone and the modules in order of the bytes they remove (largest first, growing sets), each at
prefetch depth 1 and 2; combinations megatron_ext.offload refuses (a recomputed module offloaded,
offload under full recompute) are left out. A candidate fits when every stage's predicted peak is
within the budget; fitting candidates are ranked by predicted step time, the others by their peak, and
a fitting candidate whose offload copies the host link cannot hide (``exposes_copies``) comes after
every fitting one whose copies hide or that offloads nothing: the search never picks an offload that
stalls the compute stream while another configuration fits. A candidate is its settings (``megatron_ext.planner.settings``): the run as given is evaluated once,
as itself, and its flags are those that differ from the run's.

When nothing fits, the nearest ways to fit (``nearest``), ranked by how far over the budget their
fullest stage is: the closest candidates of each kind the search evaluated (another layout,
recompute / offload on the run's layout), and more GPUs: the smallest world size (2, 4, 8, 16 times
the run's) at which the run's split (and with --search-parallelism the nearest splits) fits with the
extra GPUs as data, pipeline, expert or tensor parallelism, each with every recompute / offload
option, where no new trace is needed (a larger TP is tried when the search already traced it).
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import sys

from megatron_ext.errors import ConfigError
from megatron_ext.planner import memory, profiles, steptime
from megatron_ext.planner import settings as st
from megatron_ext.planner import trace as tr
from megatron_ext.planner.run import recompute_of, resolved_recompute, target_config
from megatron_ext.planner.hardware import GPUS

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
    settings: dict = dataclasses.field(default_factory=dict)  # the configuration (settings.of_args)
    kind: str = ""  # among the nearest ways to fit: "more GPUs", "another layout", "recompute / offload", "as given"
    launch: dict | None = None  # the command that runs it (megatron_ext.planner.launch), where the CLI made one

    @property
    def peak(self) -> float:
        return max(self.peak_bytes_per_stage)

    def as_json(self) -> dict:
        return dict(flags=self.flags, as_given=self.as_given, fits=self.fits, peak_bytes_per_stage=[round(p) for p in self.peak_bytes_per_stage],
                    step_time_s=self.step_time_s, why=self.why, layout=self.layout,
                    world_size=self.settings.get("--world-size"),
                    time={k: v for k, v in self.time.items() if k.endswith("_s")})


class Tracer:
    """Traces, cached by what changes them: per-rank widths (TP, expert TP), recompute and the attention
    of a context-parallel rank."""

    def __init__(self):
        self.cache: dict = {}

    def _key(self, args, recompute: str | None) -> tuple:
        return (args.tensor_model_parallel_size, args.expert_tensor_parallel_size,
                resolved_recompute(args, recompute), args.transformer_impl, args.context_parallel_size,
                str(args.cp_comm_type),
                memory.fixed_budget_rows(args, args.expert_model_parallel_size, args.tensor_model_parallel_size))

    def __call__(self, args, recompute: str | None) -> dict:
        """``recompute`` None: as the run has it (its own --recompute-modules)."""
        key = self._key(args, recompute)
        if key not in self.cache:
            own = resolved_recompute(args, recompute) == resolved_recompute(args)
            self.cache[key] = tr.trace(args, None if own else recompute)
        return self.cache[key]

    def has(self, args, recompute: str | None) -> bool:
        """Traced already (evaluating ``args`` with ``recompute`` costs no trace)."""
        return self._key(args, recompute) in self.cache


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
    """Every flag of the split ``args`` has (its world size aside)."""
    return st.render(st.layout_of(args), [f for f in st.LAYOUT if f != "--world-size"])


def _notes(args, recompute: str, modules: tuple) -> list:
    notes = []
    if recompute == "none" and recompute_of(args) != "none":
        notes.append("recompute off (drop recompute_granularity)")
    if not modules and args.activation_offload_modules:
        notes.append("offload off (drop activation_offload_modules)")
    return notes


def _reparse(args, flags: list, drop_uneven: bool, parse_run):
    """The run's arguments with a layout's ``flags``, validated again by ``parse_run`` (the search's
    ``reparse``: megatron derives values from the sizes); None when refused (the reason on stderr)."""
    if drop_uneven:  # first/last stage layer counts belong to the recipe's pipeline size
        flags = [*flags, "--decoder-first-pipeline-num-layers", "0", "--decoder-last-pipeline-num-layers", "0"] \
            if args.decoder_first_pipeline_num_layers else flags
    try:
        return parse_run(flags)
    except (ConfigError, ValueError, AssertionError) as e:
        print(f"planner: {' '.join(flags)} refused: {str(e).splitlines()[-1][:200]}", file=sys.stderr)
        return None


CP_SIZES = (2, 4, 8)


def context_parallel_choices(args, context_parallel: bool) -> list:
    """(CP size, its flags) a split may take: the run's own, or with ``context_parallel`` each size of
    CP_SIZES the sequence splits into (2 x CP chunks) with each comm type (megatron_ext.attention's:
    torch or transformer-engine attention; megatron's unfused attention runs on one CP rank)."""
    if not context_parallel:
        return [(args.context_parallel_size or 1, [])]
    from megatron_ext.attention.context_parallel import COMM_TYPES
    from megatron_ext.planner.work import attention_kind

    if attention_kind(args) == "unfused":
        return []
    return [(cp, ["--context-parallel-size", str(cp), "--cp-comm-type", comm])
            for cp in CP_SIZES if args.seq_length % (2 * cp) == 0 for comm in COMM_TYPES]


def layouts(args, parse_run, context_parallel: bool = False) -> list:
    """Parallel splits of the run's world size that megatron accepts (same global batch), each
    validated as --dry-run does; with ``context_parallel``, those with context parallelism (its
    ranks taken from data parallelism)."""
    out = []
    world, layers = args.world_size, args.num_layers
    heads = args.num_attention_heads
    groups = (args.num_query_groups or heads) if args.group_query_attention else heads
    experts = args.num_experts or 0
    cps = context_parallel_choices(args, context_parallel)
    for tp in (1, 2, 4, 8):
        if heads % tp or groups % tp or world % tp or (args.ffn_hidden_size or 0) % tp:
            continue
        for pp, (cp, cp_flags) in itertools.product((1, 2, 4, 8, 16, 32), cps):
            if world % (tp * pp * cp) or layers % pp:
                continue
            dp = world // (tp * pp * cp)
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
                                 "--micro-batch-size", str(mbs), "--world-size", str(world), *cp_flags]
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


def _evaluate(args, tracer: Tracer, budget: float, dev: profiles.Device, link: float, given: dict,
              recomputes=RECOMPUTE) -> list:
    """Every recompute / offload option on the split ``args``, except the run as given (``given``:
    its settings), which is its own candidate."""
    config = target_config(args)
    layout = memory.Layout.from_args(args)
    min_bytes = int(args.activation_offload_min_tensor_kb * 1024)  # the run's: its command keeps it
    out = []
    for recompute in recomputes:
        traced = tracer(args, recompute)
        scaled = tr.scaled(args, traced)
        for mods in _offload_sets(scaled, min_bytes, recompute):
            for depth in ((1, 2) if mods else (1,)):
                off = memory.Offload(mods, depth, min_bytes)
                stages = memory.predict(args, config, scaled, off)
                pool = max(-s["components"]["offload_removed"] for s in stages)
                chosen = {**st.layout_of(args), **st.recompute_choice(recompute),
                          **st.offload_choice(mods, depth, max(64, math.ceil(pool * 1.25 / 2**20)), given)}
                if st.key(chosen) == st.key(given):
                    continue
                group = _group_bytes(scaled, stages, off)
                t = steptime.step_time(args, layout, stages, group, dev, link, recompute)
                peaks = [s["peak_bytes"] for s in stages]
                fits, why = _why(peaks, budget)
                if t["offload_exposed_s"] > 0:
                    why += f"; the host link cannot hide {t['offload_exposed_s']:.2f} s of copies"
                notes = _notes(args, recompute, mods)
                if notes:
                    why += "; " + ", ".join(notes)
                out.append(Candidate(st.flags_between(given, chosen), fits, peaks, t["step_time_s"], why, stages, t,
                                     layout.describe(), settings=chosen))
    return out


def plan(args, gpu: str = "h100", memory_gb: float | None = None, host_link_gbps: float | None = None,
         search_parallelism: bool = False, top: int = 5, efficiency: float | None = None,
         flag_prefix: str = "--", recomputes=RECOMPUTE, tracer: Tracer | None = None, reparse=None,
         refuse: bool = True, gpus_per_node: int = 8, profile="stored") -> dict:
    """{"stages": the run as given, per stage, "candidates": best first, "budget_bytes", ...,
    "given_settings", "nearest": the nearest ways to fit when nothing fits, "refusal": that one-line
    message or None}. Raises ConfigError naming the flag for an unknown GPU, and with ``refuse`` for a
    budget nothing meets. ``reparse`` (a layout's flags -> the run's arguments with them) validates
    the layouts of ``search_parallelism`` and of more GPUs (without it, no more-GPUs hint). Step times use the GPU's
    stored hardware profile where there is one (``profile``: "stored", a profile dict, or None for
    the datasheet model only; ``profiles.device``); "kernels" says which."""
    if gpu not in GPUS:
        raise ConfigError(f"{flag_prefix}gpu={gpu}: unknown GPU; known: {', '.join(sorted(GPUS))}")
    g = GPUS[gpu]
    budget = memory_gb * GIB if memory_gb else g["memory_gib"] * GIB * RESERVE
    dev = profiles.device(gpu, profile, gemm_efficiency=efficiency)  # the stored profile, else the datasheet
    link = host_link_gbps * 1e9 if host_link_gbps else dev.host_link
    tracer = tracer or Tracer()
    given = tracer(args, None)  # the run as given
    given_settings = st.of_args(args)
    layout = memory.Layout.from_args(args)
    scaled = tr.scaled(args, given)
    as_given = memory.predict(args, target_config(args), scaled)
    off = memory.Offload.from_args(args)
    t = steptime.step_time(args, layout, as_given, _group_bytes(scaled, as_given, off), dev, link,
                           resolved_recompute(args))
    peaks = [s["peak_bytes"] for s in as_given]
    fits, why = _why(peaks, budget)
    given_candidate = Candidate([], fits, peaks, t["step_time_s"], "as given: " + why, as_given, t,
                                layout.describe(), as_given=True, settings=given_settings)
    evaluate = dict(tracer=tracer, budget=budget, dev=dev, link=link, given=given_settings,
                    recomputes=recomputes)
    splits = layouts(args, reparse) if search_parallelism else [args]
    candidates = [c for a in splits for c in _evaluate_split(a, evaluate)]
    if search_parallelism and not fits and not any(c.fits for c in candidates):
        # a sequence that does not fit: context parallelism splits it (each size a trace per comm type)
        candidates += [c for a in layouts(args, reparse, context_parallel=True) for c in _evaluate_split(a, evaluate)]
    candidates.sort(key=lambda c: (not c.fits, c.step_time_s if c.fits else c.peak, len(c.flags)))
    # the run as given first when it fits: nothing to change, no recompute or offload it does not need
    candidates = [given_candidate, *candidates] if fits else [*candidates, given_candidate]
    seen, unique = set(), []
    for c in candidates:  # one row per configuration (a split the layout search reaches twice, say)
        if st.key(c.settings) not in seen:
            seen.add(st.key(c.settings))
            unique.append(c)
    unique.sort(key=_rank)  # stable: the fitting ones whose copies hide, in the order above
    nearest, refusal = [], None
    if not unique[0].fits:
        nearest = _nearest(unique, given_settings, top)
        if reparse is not None:
            others = [c.settings for c in nearest if c.kind == "another layout"][:2] if search_parallelism else []
            bases = [args, *others]
            more = _more_gpus(args, bases, evaluate, reparse, gpus_per_node, context_parallel=search_parallelism)
            nearest = ([more] if more else []) + nearest
        refusal = _refusal(nearest, budget, flag_prefix, memory_gb, gpu, gpus_per_node)
        if refuse:
            raise ConfigError(refusal)
    return dict(gpu=gpu, budget_bytes=budget, host_link_bytes_per_s=link, kernels=dev.describe(),
                layout=layout.describe(), stages=as_given, candidates=unique[:top], all_candidates=len(unique),
                as_given=given_candidate, given_settings=given_settings, nearest=nearest, refusal=refusal,
                trace_divisor=given["divisor"])


def exposes_copies(c: Candidate) -> bool:
    """The host link cannot hide the candidate's offload copies (predicted exposed time)."""
    return c.time.get("offload_exposed_s", 0.0) > 0.0


def _rank(c: Candidate) -> tuple:
    """Fitting first; among those, the ones whose offload copies hide: an offload that stalls the
    compute stream is never chosen while another configuration fits the budget."""
    return (not c.fits, c.fits and exposes_copies(c))


def _evaluate_split(a, evaluate: dict) -> list:
    try:
        return _evaluate(a, **evaluate)
    except (ValueError, AssertionError, RuntimeError) as e:  # a split megatron refuses
        print(f"planner: {memory.Layout.from_args(a).describe()} skipped: {str(e).splitlines()[-1][:200]}",
              file=sys.stderr)
        return []


def _kind(c: Candidate, given: dict) -> str:
    same_split = all(c.settings[f] == given[f] for f in st.LAYOUT)
    return "as given" if c.as_given else "recompute / offload" if same_split else "another layout"


def _nearest(candidates: list, given: dict, top: int) -> list:
    """The candidates closest to the budget (lowest fullest-stage peak): the closest of each kind,
    then the next closest, ``top`` in all, ranked by peak."""
    by_peak = sorted(candidates, key=lambda c: c.peak)
    for c in by_peak:
        c.kind = _kind(c, given)
    firsts = list({c.kind: c for c in reversed(by_peak)}.values())
    chosen = firsts + [c for c in by_peak if c not in firsts][:max(0, top - len(firsts))]
    return sorted(chosen, key=lambda c: c.peak)


def _grown(base, k: int, reparse, gpus_per_node: int, traced, context_parallel: bool = False) -> list:
    """The split ``base`` on k times its GPUs, the extra ones as data, pipeline, expert or tensor
    parallelism (with ``context_parallel``, context parallelism too: the first comm type megatron and
    the attention accept, a trace of its own), each validated by megatron; the sizes that cannot divide
    (the global batch, the layers, the experts, the heads) or whose TP has no trace (``traced``: args ->
    bool) are not parsed."""
    tp, pp, ep = base.tensor_model_parallel_size, base.pipeline_model_parallel_size, base.expert_model_parallel_size
    layout = memory.Layout.from_args(base)
    uneven = bool(base.decoder_first_pipeline_num_layers or base.decoder_last_pipeline_num_layers)
    variants = []
    if base.global_batch_size % (layout.mbs * layout.dp * k) == 0:
        variants.append(([], False))
    if uneven or base.num_layers % (pp * k * (layout.vpp or 1)) == 0:
        variants.append((["--pipeline-model-parallel-size", str(pp * k)], True))
    if base.num_experts and base.num_experts % (ep * k) == 0:
        variants.append((["--expert-model-parallel-size", str(ep * k)], False))
    wider = copy.copy(base)  # as the TP variant will parse: a dense model's expert TP follows its TP
    wider.tensor_model_parallel_size, wider.sequence_parallel = tp * k, True
    if not base.num_experts:
        wider.expert_tensor_parallel_size = tp * k
    if tp * k <= gpus_per_node and base.num_attention_heads % (tp * k) == 0 and traced(wider):
        variants.append((["--tensor-model-parallel-size", str(tp * k), "--sequence-parallel"], False))
    world = ["--world-size", str(base.world_size * k)]
    out = []
    for flags, pp_changes in variants:
        a = _reparse(base, [*_layout_flags(base), *world, *flags], pp_changes, reparse)
        if a is not None:
            out.append(a)
    if context_parallel and (base.context_parallel_size or 1) == 1:  # context parallelism over the new GPUs
        for flags in (flags for cp, flags in context_parallel_choices(base, True) if cp == k):
            a = _reparse(base, [*_layout_flags(base), *world, *flags], False, reparse)
            if a is not None:
                out.append(a)
                break
    return out


def _more_gpus(args, bases: list, evaluate: dict, reparse, gpus_per_node: int,
               context_parallel: bool = False) -> Candidate | None:
    """The fastest configuration that fits at the smallest world size (2 to 16 times the run's) on
    one of ``bases`` (the run's split and nearest splits) with more GPUs; splits that would need a new
    trace are left out, but for context parallelism's (with ``context_parallel``)."""
    given = evaluate["given"]
    splits = []
    for b in bases:
        if isinstance(b, dict):  # a split as settings: parse it as the run with these flags
            b = _reparse(args, st.render(b, [f for f in st.LAYOUT if f != "--world-size"]),
                         b["--pipeline-model-parallel-size"] != args.pipeline_model_parallel_size, reparse)
        if b is not None:
            splits.append(b)
    def traced(a) -> bool:  # evaluating ``a`` needs no new trace
        return all(evaluate["tracer"].has(a, r) for r in evaluate["recomputes"])

    seen = set()
    for k in (2, 4, 8, 16):
        fitting = []
        for a in (x for b in splits for x in _grown(b, k, reparse, gpus_per_node, traced, context_parallel)):
            layout_key = st.key({**given, **st.layout_of(a)})
            if layout_key in seen or not (traced(a) or a.context_parallel_size > (args.context_parallel_size or 1)):
                continue
            seen.add(layout_key)
            fitting += [c for c in _evaluate_split(a, evaluate) if c.fits]
        if fitting:
            best = min(fitting, key=lambda c: (c.step_time_s, len(c.flags)))
            best.kind = "more GPUs"
            return best
    return None


def _refusal(nearest: list, budget: float, flag_prefix: str, memory_gb, gpu: str, gpus_per_node: int) -> str:
    """The one-line refusal: the closest candidate on these GPUs and, if found, the GPUs that fit."""
    from megatron_ext.planner.launch import nodes_for

    here = [c for c in nearest if c.kind != "more GPUs"]
    closest = here[0] if here else None
    what = (f"; closest: {' '.join(closest.flags) or 'as given'} ({closest.layout}) needs {closest.peak / GIB:.1f} GiB"
            if closest else "")
    more = next((c for c in nearest if c.kind == "more GPUs"), None)
    if more:
        world = more.settings["--world-size"]
        nodes, per_node = nodes_for(world, gpus_per_node)
        what += f"; fits on {world} GPUs ({nodes} x {per_node}): {' '.join(more.flags)} ({more.peak / GIB:.1f} GiB)"
    given_flag = f"{flag_prefix}memory-gb={memory_gb}" if memory_gb else f"{flag_prefix}gpu={gpu}"
    return f"{given_flag}: no configuration fits {budget / GIB:.1f} GiB per GPU{what}"
