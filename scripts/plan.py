"""Predict each pipeline stage's peak memory and the step time of a recipe on a GPU cluster, and
choose the offload / prefetch / recompute (with --search-parallelism also the TP/PP/VPP/EP/micro-batch
split) that fits a memory budget at the least step time, with the torchrun / sbatch command that runs
it; when nothing fits, the nearest ways to fit. See docs/planner.md.

    PYTHONPATH=. .venv/bin/python scripts/plan.py --recipe recipes/cluster/llama3_70b.yaml --gpu h100 \
        [--memory-gb N] [--host-link-gbps N] [--gpus-per-node N] [--search-parallelism] [--json] [--png FILE]
        [train.py flags]

Same as `train.py --recipe R --plan [--plan-gpu ...]` (recipe keys plan_gpu:, plan_memory_gb:, ...).
The run is planned as the cluster runs it: megatron's transformer-engine spec unless --assume-no-te
(then the local spec, traced exactly). Predictions only: not measured on GPU.
"""
from __future__ import annotations

import argparse
import sys



def usage_parser() -> argparse.ArgumentParser:
    """--help: the planner's options (megatron_ext.planner.PlanOptions, spelled --NAME here) and where
    the run's flags go. The options are parsed with the run's flags by train.py's argument table."""
    from megatron_ext.config.typed import add_group_without_torch
    from megatron_ext.planner.options import DESCRIPTION, TITLE, PlanOptions

    p = argparse.ArgumentParser(
        prog="scripts/plan.py", description=__doc__.split("\n\n")[0],
        epilog="Every other flag is train.py's (its recipe, megatron's flags, --assume-no-te for the local "
        "spec); `train.py --help` lists them. Refusals are one line naming the flag. Docs: docs/planner.md.")
    p.add_argument("--recipe", metavar="YAML", help="the run's recipe (recipes/cluster/*.yaml)")
    add_group_without_torch(p, PlanOptions, TITLE, DESCRIPTION, flag_prefix="--")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        usage_parser().print_help()
        return 0
    from megatron_ext import errors, platform

    errors.quiet(argv)  # third-party warnings that tell the user nothing (--verbose shows them)
    platform.setup()  # before megatron-core is imported
    import arguments

    from megatron_ext import planner

    errors.run(lambda: planner.main(argv, parse=arguments.parse), explain=arguments.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
