"""The planner: each pipeline stage's peak device memory and the step time of a run, predicted from
the model itself, and the offload / prefetch / recompute (and parallel layout) that fits a memory
budget at the least step time. See docs/planner.md.

    scripts/plan.py --recipe R [flags] --gpu h100 [--memory-gb N] [--host-link-gbps N] [--json]
    train.py --recipe R [flags] --plan [--plan-gpu h100] [--plan-memory-gb N] ...

Entry points: ``predict_memory(args)`` (per-stage bytes for parsed arguments) and ``plan(...)`` (the
search); ``main(argv)`` is the command line of both.
"""
from __future__ import annotations

__all__ = ["add_arguments", "predict_memory", "plan", "main"]


def add_arguments(parser):
    from megatron_ext.planner.hardware import GPUS

    g = parser.add_argument_group("megatron_ext: planner", "predict each stage's peak memory and the step time; "
                                  "choose offload / recompute / layout for a budget (docs/planner.md)")
    g.add_argument("--plan", action="store_true",
                   help="Print the plan for this recipe and flags instead of training (same as scripts/plan.py).")
    g.add_argument("--plan-gpu", choices=sorted(GPUS), default="h100", help="GPU the plan is for.")
    g.add_argument("--plan-memory-gb", type=float, default=None,
                   help="Device memory budget per GPU in GiB (default: the GPU's memory less 10%% reserve).")
    g.add_argument("--plan-host-link-gbps", type=float, default=None,
                   help="Host link bandwidth per GPU in GB/s, each direction (default: the GPU's PCIe).")
    g.add_argument("--plan-search-parallelism", action="store_true",
                   help="Also search the TP/PP/VPP/EP/micro-batch split for the run's world size.")
    g.add_argument("--plan-json", action="store_true", help="Print the plan as JSON.")
    g.add_argument("--plan-png", default=None, metavar="FILE",
                   help="Also draw per stage memory by component, before/after the chosen offload.")
    return parser


def predict_memory(args, recompute=None, offload=None, trace=None, backend: str = "nccl") -> list:
    """Per pipeline stage: {"stage", "peak_bytes", "components", ...} for parsed arguments
    (``megatron_ext.planner.memory``), with this run's offload unless ``offload`` is given. Traces
    a tiny copy of the model on this process (needs the default process group; model-parallel
    state is set up and torn down around the trace)."""
    from megatron_ext.planner import memory
    from megatron_ext.planner import trace as tr

    config = target_config(args)
    traced = trace if trace is not None else tr.trace(args, recompute)
    scaled = tr.Scaled(traced, tr.factors_for(args, traced), ep=args.expert_model_parallel_size)
    return memory.predict(args, config, scaled, offload, backend)


def target_config(args):
    """The run's TransformerConfig, built without a model (as --dry-run does)."""
    import contextlib
    import io

    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_ext.planner.trace import buildable_here

    with contextlib.redirect_stdout(io.StringIO()):  # only its layer layout is read: kernels do not matter
        return core_transformer_config_from_args(buildable_here(args))


def plan(*args, **kwargs):
    from megatron_ext.planner.search import plan as _plan

    return _plan(*args, **kwargs)


def main(argv: list | None = None, prefix: str = "--"):
    """The command line: scripts/plan.py's flags (prefix "--": --gpu, --memory-gb, ...) or
    train.py's (prefix "--plan-": --plan-gpu, --plan-memory-gb, ...)."""
    from megatron_ext.planner.cli import main as _main

    return _main(argv, prefix)
