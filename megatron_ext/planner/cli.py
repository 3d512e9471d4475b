"""The planner's command line (scripts/plan.py, train.py --plan): the run as given, per stage and
component, then the best candidates for the budget, the flags of the winner and the command that
runs it (``megatron_ext.planner.launch``); when nothing fits, the nearest ways to fit and then the
one-line refusal."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import sys

GIB = 2**30
COMPONENTS = ("parameters", "gradients", "optimizer", "buffers", "activations", "working_set", "moe_dispatch",
              "offload_removed")


def train_flags(argv: list) -> list:
    """scripts/plan.py's spellings (--gpu, --memory-gb=N, ...) as train.py's (--plan-gpu, ...): one
    declaration (``megatron_ext.planner.options.PlanOptions``) for both and for recipe keys (plan_gpu: ...)."""
    from megatron_ext.planner.options import NAMES

    out = []
    for a in argv:
        name, eq, value = a.partition("=")
        if name.startswith("--") and name[2:] in NAMES:
            a = f"--plan-{name[2:]}{eq}{value}"
        out.append(a)
    return out


def target_flags(argv: list) -> list:
    """Validate for the GPU cluster the plan is for: --platform cuda, transformer-engine there unless
    --assume-no-te (megatron's own default spec), the GPU named by --plan-gpu."""
    given = {a.partition("=")[0] for a in argv}
    out = [] if "--platform" in given else ["--platform", "cuda"]
    if not given & {"--assume-te", "--assume-no-te"}:
        out.append("--assume-te")
    return out


def parse(argv: list, prefix: str, parse_run):
    """(the planner's options, ``PlanOptions``; the run's parsed arguments validated for the GPU
    cluster; the run's command line they were parsed from, target flags included: a layout of the
    search is these flags and its own, validated again). The options and the arguments come from one
    parse of the argument table (``parse_run``: ``arguments.parse``, whose domain check refuses an
    option out of range by its flag), so a recipe's ``plan_gpu:`` is read as --plan-gpu is."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner.hardware import GPUS
    from megatron_ext.planner.options import PlanOptions

    run_argv = list(argv) if prefix == "--plan-" else train_flags(argv)
    run_argv += target_flags(run_argv)
    args = _parse_run(parse_run, run_argv)
    opts = PlanOptions.from_args(args)
    if opts.gpu not in GPUS:
        raise ConfigError(f"{prefix}gpu={opts.gpu}: unknown GPU; known: {', '.join(sorted(GPUS))}")
    if args.platform == "cuda" and args.target_gpu is None:
        run_argv += ["--target-gpu", opts.gpu]
        args = _parse_run(parse_run, run_argv)
    return opts, args, run_argv


def _parse_run(parse_run, argv: list):
    """The run's arguments, validated as --dry-run does (megatron's derived values included)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return parse_run([*argv, "--dry-run"], exit_on_dry_run=False)


def reparse(parse_run, run_argv: list = ()):
    """flags -> the run's arguments with them (``run_argv``'s flags, then these), validated again:
    the search's layouts, and (with no ``run_argv``) a launch's whole command line."""
    return lambda flags: _parse_run(parse_run, [*run_argv, *flags])


def stage_table(stages: list) -> str:
    head = ("stage", *COMPONENTS, "peak GiB", "at")
    rows = [head]
    for s in stages:
        c = s["components"]
        rows.append((str(s["stage"]), *(f"{c[k] / GIB:.2f}" for k in COMPONENTS), f"{s['peak_bytes'] / GIB:.2f}", s["at"]))
    return grid(rows)


def chunk_table(stages: list) -> str:
    """Per stage and model chunk (VPP): its layers, parameters, the activations one micro-batch saves
    in it, and what its passes hold at the stage's peak."""
    rows = [("stage", "chunk", "layers", "parameters", "activations per micro-batch", "held at the peak")]
    for s in stages:
        for ch in s["chunks"]:
            layers = " ".join(f"{k}x{n}" for k, n in _runs(ch["layers"]))
            rows.append((str(s["stage"]), str(ch["chunk"]), layers, f"{ch['parameters'] / GIB:.2f}",
                         f"{ch['activations_per_microbatch'] / GIB:.2f}", f"{ch['activations_at_peak'] / GIB:.2f}"))
    return grid(rows)


def _runs(items: list) -> list:
    out: list = []
    for x in items:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return out


def _chunk_json(ch: dict) -> dict:
    return dict(chunk=ch["chunk"], layers=ch["layers"], parameters=round(ch["parameters"]),
                activations_per_microbatch=round(ch["activations_per_microbatch"]),
                activations_at_peak=round(ch["activations_at_peak"]))


def grid(rows) -> str:
    """A table in text (the plan's and the benchmarks'): the first row the header, a rule under it,
    every column left-aligned to its widest cell (cells are strings)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    out.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(out)


def as_given_json(c) -> dict:
    """The run exactly as its flags say: per stage peak, step time and throughput (predicted)."""
    return dict(peak_bytes_per_stage=[round(p) for p in c.peak_bytes_per_stage], step_time_s=c.step_time_s,
                tokens_per_s_per_gpu=c.time["tokens_per_s_per_gpu"], model_tflops_per_gpu=c.time["model_tflops_per_gpu"],
                fits=c.fits, time={k: v for k, v in c.time.items() if k.endswith("_s")},
                attention=c.time.get("attention"), slowest_stage=c.time.get("slowest_stage"))


def time_line(t: dict) -> str:
    return " + ".join(f"{k[:-2]} {v:.3g}" for k, v in t.items() if k.endswith("_s") and k != "step_time_s")


def candidate_table(cands: list) -> str:
    rows = [("#", "fits", "step s", "largest stage GiB", "layout", "flags", "why")]
    for i, c in enumerate(cands):
        rows.append((str(i + 1), "yes" if c.fits else "no", f"{c.step_time_s:.3f}",
                     f"{max(c.peak_bytes_per_stage) / GIB:.2f}", c.layout,
                     "(as given)" if c.as_given else (" ".join(c.flags) or "(recipe changes only: see why)"), c.why))
    return grid(rows)


def nearest_table(nearest: list, budget: float, gpus_per_node: int) -> str:
    from megatron_ext.planner.launch import nodes_for

    rows = [("#", "kind", "GPUs", "fits", "step s", "largest stage GiB", "over budget GiB", "layout", "flags")]
    for i, c in enumerate(nearest):
        world = c.settings["--world-size"]
        nodes, per_node = nodes_for(world, gpus_per_node)
        rows.append((str(i + 1), c.kind, f"{world} ({nodes} x {per_node})", "yes" if c.fits else "no",
                     f"{c.step_time_s:.3f}", f"{c.peak / GIB:.2f}", f"{(c.peak - budget) / GIB:+.2f}", c.layout,
                     "(as given)" if c.as_given else (" ".join(c.flags) or "(recipe changes only)")))
    return grid(rows)


@contextlib.contextmanager
def logs_to_stderr():
    """megatron's root log handler writes to the stdout of its import time: while planning, its
    records go to stderr, so that stdout is the plan's (one JSON object with --json)."""
    moved = [h for h in logging.getLogger().handlers
             if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.__stdout__)]
    old = [h.setStream(sys.stderr) for h in moved]
    try:
        yield
    finally:
        for h, stream in zip(moved, old):
            h.setStream(stream)


def run(argv: list, prefix: str, parse_run, refuse: bool = True, tracer=None) -> tuple:
    """(options, the search's result, the --json report) for a command line, printing nothing on
    stdout. ``refuse``: a budget nothing meets is a ConfigError (else the result says so in
    ``refusal``, with the nearest ways to fit)."""
    with logs_to_stderr():
        return _run(argv, prefix, parse_run, refuse, tracer)


def _run(argv: list, prefix: str, parse_run, refuse: bool, tracer) -> tuple:
    from megatron_ext import platform
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import launch
    from megatron_ext.planner.search import plan

    opts, args, run_argv = parse(argv, prefix, parse_run)
    platform.init_distributed()  # the trace runs a tiny copy of the model on this process
    log = logging.getLogger("megatron")
    level = log.level
    log.setLevel(logging.ERROR)  # building the tiny copies warns; stdout stays the plan's
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = plan(args, gpu=opts.gpu, memory_gb=opts.memory_gb, host_link_gbps=opts.host_link_gbps,
                          search_parallelism=opts.search_parallelism, top=opts.top, flag_prefix=prefix,
                          reparse=reparse(parse_run, run_argv), refuse=False, tracer=tracer,
                          gpus_per_node=opts.gpus_per_node)
    finally:
        log.setLevel(level)
    if refuse and result["refusal"]:
        raise ConfigError(result["refusal"])

    def launch_of(c):  # parsed back as train.py will parse it (launch.build's check)
        return launch.build(args, run_argv, result["given_settings"], c.settings, opts.gpu, opts.gpus_per_node,
                            check=reparse(parse_run))

    best = result["candidates"][0]
    result["launch"] = launch_of(best) if best.fits else None
    for c in result["nearest"]:
        c.launch = launch_of(c) if c.fits else None
    report = dict(stages=[dict(stage=s["stage"], peak_bytes=round(s["peak_bytes"]),
                               components={k: round(v) for k, v in s["components"].items()},
                               in_flight=s["in_flight"], at=s["at"], chunks=[_chunk_json(ch) for ch in s["chunks"]])
                          for s in result["stages"]],
                  candidates=[c.as_json() for c in result["candidates"]], gpu=result["gpu"], kernels=result["kernels"],
                  budget_bytes=round(result["budget_bytes"]), layout=result["layout"],
                  as_given=as_given_json(result["as_given"]),
                  launch=launch.as_json(result["launch"]) if result["launch"] else None,
                  nearest=[dict(c.as_json(), kind=c.kind, peak_bytes=round(c.peak),
                                over_budget_bytes=round(c.peak - result["budget_bytes"]),
                                launch=launch.as_json(c.launch) if c.launch else None) for c in result["nearest"]],
                  refusal=result["refusal"])
    return opts, result, report


def main(argv: list | None, prefix: str, parse_run) -> dict:
    from megatron_ext.errors import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    opts, result, report = run(argv, prefix, parse_run, refuse=False)
    if opts.png:
        from megatron_ext.planner.picture import draw

        draw(result, opts.png)
    if opts.json:
        print(json.dumps(report, indent=1))
    else:
        _print_plan(opts, result)
    if result["refusal"]:
        sys.stdout.flush()
        raise ConfigError(result["refusal"])
    return report


def _print_plan(opts, result: dict) -> None:
    from megatron_ext.planner import launch

    print(f"{result['layout']} on {opts.gpu}: budget {result['budget_bytes'] / GIB:.1f} GiB per GPU, host link "
          f"{result['host_link_bytes_per_s'] / 1e9:.0f} GB/s; {result['kernels']} (predicted; the run itself "
          "not measured on GPU)")
    g = result["as_given"]
    print(f"\nAs given: {'fits' if g.fits else 'does not fit'}; {g.step_time_s:.3f} s per step = "
          f"{time_line(g.time)} s; {g.time['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
          f"{g.time['model_tflops_per_gpu']:.0f} model TFLOP/s/GPU")
    print("\nAs given, per pipeline stage (GiB):")
    print(stage_table(result["stages"]))
    print("\nPer model chunk (GiB; activations: saved for backward):")
    print(chunk_table(result["stages"]))
    best = result["candidates"][0]
    if best.fits:
        print(f"\nBest {len(result['candidates'])} of {result['all_candidates']} candidates:")
        print(candidate_table(result["candidates"]))
        print("\nFlags of the winner: " + ("(none: the run fits as given)" if best.as_given else " ".join(best.flags)
                                            or "(none: drop the run's recompute / offload)"))
        print("Launch: " + launch.text(result["launch"]))
    else:
        print(f"\nNo configuration fits {result['budget_bytes'] / GIB:.1f} GiB per GPU. The nearest ways to fit, "
              "by the predicted peak of the fullest stage:")
        print(nearest_table(result["nearest"], result["budget_bytes"], opts.gpus_per_node))
        more = next((c for c in result["nearest"] if c.launch), None)
        if more:
            print("Launch with more GPUs: " + launch.text(more.launch))
        elif not any(c.kind == "more GPUs" for c in result["nearest"]):
            print("More GPUs: no split of up to 16 times the GPUs that the search could evaluate without a new trace "
                  "fits" + ("" if opts.search_parallelism else " (--search-parallelism also tries larger TP)"))
    if opts.png:
        print(f"Picture: {opts.png}")
