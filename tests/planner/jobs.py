"""Job functions for the planner tests (every rank of a gloo world)."""
from __future__ import annotations


def plan_json(argv, prefix="--"):
    """scripts/plan.py's report for argv (train.py's with prefix "--plan-"), or the one-line refusal."""
    import arguments

    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import cli

    try:
        return dict(report=cli.main([*argv, f"{prefix}json"], prefix, arguments.parse))
    except ConfigError as e:
        return dict(error=str(e))
