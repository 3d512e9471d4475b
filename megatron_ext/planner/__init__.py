"""The planner: each pipeline stage's peak device memory and the step time of a run, predicted from
the model itself, and the offload / prefetch / recompute (and parallel layout) that fits a memory
budget at the least step time, with the command that runs it (launch.py). See docs/planner.md.

    scripts/plan.py --recipe R [flags] --gpu h100 [--memory-gb N] [--host-link-gbps N] [--json]
    train.py --recipe R [flags] --plan [--plan-gpu h100] [--plan-memory-gb N] ...

Its options are declared once, in options.py (``PlanOptions``, a typed dataclass): train.py and recipes
spell them ``--plan-NAME`` / ``plan_NAME:``, scripts/plan.py ``--NAME``; both go through megatron_ext's
argument table.
Entry points: ``add_arguments(parser)``, ``predict_memory(args)`` (per-stage bytes for parsed
arguments), ``plan(...)`` (the search) and ``main(argv, prefix, parse)`` (the command line of both).

The package imports the runtime's vocabulary (offload options, dispatch budgets, megatron's
schedules) and ``megatron_ext.measure``, never the argument table (``arguments``: the entry point
hands its ``parse`` in) nor the benchmarks' helpers (scripts/bench/).
"""
from __future__ import annotations

__all__ = ["PlanOptions", "add_arguments", "predict_memory", "plan", "main"]

from megatron_ext.planner.options import PlanOptions, add_arguments  # noqa: F401 (the package's API)


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


def main(argv: list | None = None, prefix: str = "--", *, parse):
    """The command line: scripts/plan.py's flags (prefix "--": --gpu, --memory-gb, ...) or
    train.py's (prefix "--plan-": --plan-gpu, --plan-memory-gb, ...). ``parse``: the argument
    table's parse (``arguments.parse``), handed in by the entry point."""
    from megatron_ext.planner.cli import main as _main

    return _main(argv, prefix, parse)
