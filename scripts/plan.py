"""Predict each pipeline stage's peak memory and the step time of a recipe on a GPU cluster, and
choose the offload / prefetch / recompute (with --search-parallelism also the TP/PP/VPP/EP/micro-batch
split) that fits a memory budget at the least step time. See docs/planner.md.

    PYTHONPATH=. .venv/bin/python scripts/plan.py --recipe recipes/cluster/llama3_70b.yaml --gpu h100 \
        [--memory-gb N] [--host-link-gbps N] [--search-parallelism] [--json] [--png FILE] [megatron flags]

Same as `train.py --recipe R --plan [--plan-gpu ...]`. Predictions only: not measured on GPU.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    from megatron_ext import errors, platform

    platform.setup()  # before megatron-core is imported
    import arguments

    from megatron_ext import planner

    errors.run(lambda: planner.main(argv), explain=arguments.explain)


if __name__ == "__main__":
    main()
