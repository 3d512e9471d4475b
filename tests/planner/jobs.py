"""Job functions for the planner tests (every rank of a gloo world)."""
from __future__ import annotations


def plan_json(argv):
    """scripts/plan.py's report for argv, or the one-line refusal."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.planner import cli

    try:
        return dict(report=cli.main([*argv, "--json"]))
    except ConfigError as e:
        return dict(error=str(e))
