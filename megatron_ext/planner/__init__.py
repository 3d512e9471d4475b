"""The planner: each pipeline stage's peak device memory and the step time of a run, predicted from
the model itself, and the offload / prefetch / recompute (and parallel layout) that fits a memory
budget at the least step time. See docs/planner.md.

    scripts/plan.py --recipe R [flags] --gpu h100 [--memory-gb N] [--host-link-gbps N] [--json]
    train.py --recipe R [flags] --plan [--plan-gpu h100] [--plan-memory-gb N] ...

Its options are declared once, here (``OPTIONS``): train.py and recipes spell them ``--plan-NAME`` /
``plan_NAME:``, scripts/plan.py ``--NAME``; both go through megatron_ext's argument table.
Entry points: ``add_arguments(parser)``, ``predict_memory(args)`` (per-stage bytes for parsed
arguments), ``plan(...)`` (the search) and ``main(argv, prefix, parse)`` (the command line of both).

The package imports the runtime's vocabulary (offload options, dispatch budgets, megatron's
schedules) and ``megatron_ext.measure``, never the argument table (``arguments``: the entry point
hands its ``parse`` in) nor ``megatron_ext.bench``.
"""
from __future__ import annotations

__all__ = ["OPTIONS", "add_arguments", "predict_memory", "plan", "main"]

# name: argparse keywords. train.py / recipes: --plan-NAME / plan_NAME; scripts/plan.py: --NAME
OPTIONS = {
    "gpu": dict(default="h100", metavar="GPU",
                help="GPU the plan is for: a100, h100, h200, b200, gb200 (megatron_ext/planner/hardware.py)."),
    "memory-gb": dict(type=float, default=None, metavar="GIB",
                      help="Device memory budget per GPU in GiB (default: the GPU's memory less 10%% reserve)."),
    "host-link-gbps": dict(type=float, default=None, metavar="GBPS",
                           help="Host link bandwidth per GPU in GB/s, each direction (default: the GPU's PCIe)."),
    "search-parallelism": dict(action="store_true",
                               help="Also search the TP/PP/VPP/EP/micro-batch split for the run's world size."),
    "json": dict(action="store_true", help="Print the plan as one JSON object."),
    "png": dict(default=None, metavar="FILE",
                help="Also draw per stage memory by component, as given and with the chosen configuration."),
    "top": dict(type=int, default=5, metavar="N", help="How many candidates to print."),
}


def add_arguments(parser, prefix: str = "--plan-"):
    """Declare the planner's options (``--plan`` and ``OPTIONS``) on ``parser``; their dests are
    ``plan_NAME`` whatever the spelling."""
    g = parser.add_argument_group("megatron_ext: planner", "predict each stage's peak memory and the step time; "
                                  "choose offload / recompute / layout for a budget (docs/planner.md)")
    g.add_argument("--plan", action="store_true",
                   help="Print the plan for this recipe and flags instead of training (same as scripts/plan.py).")
    for name, kw in OPTIONS.items():
        g.add_argument(prefix + name, dest="plan_" + name.replace("-", "_"), **kw)
    return parser


def predict_memory(args, recompute=None, offload=None, trace=None, backend: str = "nccl") -> list:
    """Per pipeline stage: {"stage", "peak_bytes", "components", ...} for parsed arguments
    (``megatron_ext.planner.memory``), with this run's offload unless ``offload`` is given. Traces
    a tiny copy of the model on this process (needs the default process group; model-parallel
    state is set up and torn down around the trace)."""
    from megatron_ext.planner import memory
    from megatron_ext.planner import trace as tr
    from megatron_ext.planner.run import target_config

    traced = trace if trace is not None else tr.trace(args, recompute)
    return memory.predict(args, target_config(args), tr.scaled(args, traced), offload, backend)


def plan(*args, **kwargs):
    from megatron_ext.planner.search import plan as _plan

    return _plan(*args, **kwargs)


def main(argv: list | None = None, prefix: str = "--", parse=None):
    """The command line: scripts/plan.py's flags (prefix "--": --gpu, --memory-gb, ...) or
    train.py's (prefix "--plan-": --plan-gpu, --plan-memory-gb, ...). ``parse``: the argument
    table's parse (``arguments.parse``), handed in by the entry point."""
    from megatron_ext.planner.cli import main as _main

    return _main(argv, prefix, parse)
