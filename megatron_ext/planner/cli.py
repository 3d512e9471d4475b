"""The planner's command line (scripts/plan.py, train.py --plan): the run as given, per stage and
component, then the best candidates for the budget and the flags of the winner."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys

GIB = 2**30
COMPONENTS = ("parameters", "gradients", "optimizer", "buffers", "activations", "working_set", "moe_dispatch",
              "offload_removed")
# scripts/plan.py's spellings -> train.py's (declared in megatron_ext.planner.add_arguments)
SHORT = {"--gpu": "--plan-gpu", "--memory-gb": "--plan-memory-gb", "--host-link-gbps": "--plan-host-link-gbps",
         "--search-parallelism": "--plan-search-parallelism", "--json": "--plan-json", "--png": "--plan-png"}


def _own_parser(prefix: str) -> argparse.ArgumentParser:
    from megatron_ext.errors import ConfigError

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ConfigError(message)

    p = Parser(add_help=False)
    p.add_argument(f"{prefix}gpu", dest="gpu", default="h100")
    p.add_argument(f"{prefix}memory-gb", dest="memory_gb", type=float, default=None)
    p.add_argument(f"{prefix}host-link-gbps", dest="host_link_gbps", type=float, default=None)
    p.add_argument(f"{prefix}search-parallelism", dest="search_parallelism", action="store_true")
    p.add_argument(f"{prefix}json", dest="json", action="store_true")
    p.add_argument(f"{prefix}png", dest="png", default=None)
    p.add_argument("--top", type=int, default=5)
    if prefix != "--":
        p.add_argument("--plan", action="store_true")
    return p


def parse(argv: list, prefix: str = "--"):
    """(planner options, the run's parsed arguments validated for a CUDA cluster)."""
    from megatron_ext.errors import ConfigError

    opts, rest = _own_parser(prefix).parse_known_args(argv)
    flag = f"{prefix}memory-gb"
    if opts.memory_gb is not None and not opts.memory_gb > 0:
        raise ConfigError(f"{flag}={opts.memory_gb}: must be > 0")
    if opts.host_link_gbps is not None and not opts.host_link_gbps > 0:
        raise ConfigError(f"{prefix}host-link-gbps={opts.host_link_gbps}: must be > 0")
    from megatron_ext.planner.hardware import GPUS

    if opts.gpu not in GPUS:
        raise ConfigError(f"{prefix}gpu={opts.gpu}: unknown GPU; known: {', '.join(sorted(GPUS))}")
    target = [] if any(a.startswith(("--platform", "--assume")) for a in rest) else ["--platform", "cuda", "--assume-te"]
    if not any(a.startswith("--target-gpu") for a in rest) and opts.gpu in ("a100", "h100", "h200", "b200", "gb200"):
        target += ["--target-gpu", opts.gpu]
    args = parse_run([*rest, *target])
    args.plan_argv = [*rest, *target]  # a layout of the search is these flags and its own, validated again
    return opts, args


def parse_run(argv: list):
    """The run's arguments, validated as --dry-run does (megatron's derived values included)."""
    import arguments

    with contextlib.redirect_stdout(io.StringIO()):
        return arguments.parse([*argv, "--dry-run"], exit_on_dry_run=False)


def stage_table(stages: list) -> str:
    head = ("stage", *COMPONENTS, "peak GiB", "at")
    rows = [head]
    for s in stages:
        c = s["components"]
        rows.append((str(s["stage"]), *(f"{c[k] / GIB:.2f}" for k in COMPONENTS), f"{s['peak_bytes'] / GIB:.2f}", s["at"]))
    return _grid(rows)


def chunk_table(stages: list) -> str:
    """Per stage and model chunk (VPP): its layers, parameters, the activations one micro-batch saves
    in it, and what its passes hold at the stage's peak."""
    rows = [("stage", "chunk", "layers", "parameters", "activations per micro-batch", "held at the peak")]
    for s in stages:
        for ch in s["chunks"]:
            layers = " ".join(f"{k}x{n}" for k, n in _runs(ch["layers"]))
            rows.append((str(s["stage"]), str(ch["chunk"]), layers, f"{ch['parameters'] / GIB:.2f}",
                         f"{ch['activations_per_microbatch'] / GIB:.2f}", f"{ch['activations_at_peak'] / GIB:.2f}"))
    return _grid(rows)


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


def _grid(rows) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    out.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(out)


def candidate_table(cands: list) -> str:
    rows = [("#", "fits", "step s", "largest stage GiB", "layout", "flags", "why")]
    for i, c in enumerate(cands):
        rows.append((str(i + 1), "yes" if c.fits else "no", f"{c.step_time_s:.3f}",
                     f"{max(c.peak_bytes_per_stage) / GIB:.2f}", c.layout, " ".join(c.flags) or "(as given)", c.why))
    return _grid(rows)


def main(argv: list | None = None, prefix: str = "--") -> dict:
    from megatron_ext import platform
    from megatron_ext.planner.search import plan

    argv = list(sys.argv[1:] if argv is None else argv)
    opts, args = parse(argv, prefix)
    platform.init_distributed()  # the trace runs a tiny copy of the model on this process
    log = logging.getLogger("megatron")
    level = log.level
    log.setLevel(logging.ERROR)  # building the tiny copies warns; stdout stays the plan's
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result = plan(args, gpu=opts.gpu, memory_gb=opts.memory_gb, host_link_gbps=opts.host_link_gbps,
                          search_parallelism=opts.search_parallelism, top=opts.top, flag_prefix=prefix)
    finally:
        log.setLevel(level)
    if opts.png:
        from megatron_ext.planner.picture import draw

        draw(result, opts.png)
    report = dict(stages=[dict(stage=s["stage"], peak_bytes=round(s["peak_bytes"]),
                               components={k: round(v) for k, v in s["components"].items()},
                               in_flight=s["in_flight"], at=s["at"], chunks=[_chunk_json(ch) for ch in s["chunks"]])
                          for s in result["stages"]],
                  candidates=[c.as_json() for c in result["candidates"]], gpu=result["gpu"],
                  budget_bytes=round(result["budget_bytes"]), layout=result["layout"])
    if opts.json:
        print(json.dumps(report, indent=1))
        return report
    print(f"{result['layout']} on {opts.gpu}: budget {result['budget_bytes'] / GIB:.1f} GiB per GPU, host link "
          f"{result['host_link_bytes_per_s'] / 1e9:.0f} GB/s, efficiency {result['efficiency']:.0%} of peak "
          "(predicted; not measured on GPU)")
    print("\nAs given, per pipeline stage (GiB):")
    print(stage_table(result["stages"]))
    print("\nPer model chunk (GiB; activations: saved for backward):")
    print(chunk_table(result["stages"]))
    print(f"\nBest {len(result['candidates'])} of {result['all_candidates']} candidates:")
    print(candidate_table(result["candidates"]))
    best = result["candidates"][0]
    print("\nFlags of the winner: " + (" ".join(best.flags) or "(none: the run as given fits)"))
    if opts.png:
        print(f"Picture: {opts.png}")
    return report
