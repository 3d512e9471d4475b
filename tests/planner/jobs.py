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


def plan_json_recipe(extra):
    """plan_json for recipes/tiny_dense.yaml with ``extra`` keys added to the recipe."""
    import os
    import tempfile

    import yaml

    with open("recipes/tiny_dense.yaml") as f:
        recipe = dict(yaml.safe_load(f), **extra)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(recipe, f)
    try:
        return plan_json(["--recipe", f.name])
    finally:
        os.unlink(f.name)


def saved_growth(argv):
    """Bytes one dense layer saves at twice the sequence over once, traced for the transformer-engine
    target and for the local spec."""
    import contextlib
    import io

    import arguments

    from megatron_ext.planner import trace as tr

    out = {}
    for impl, assume in (("transformer_engine", "--assume-te"), ("local", "--assume-no-te")):
        sizes = []
        for seq in ("256", "512"):
            with contextlib.redirect_stdout(io.StringIO()):
                args = arguments.parse([*argv, "--transformer-impl", impl, "--platform", "cuda", assume, "--seq-length",
                                        seq, "--max-position-embeddings", "512", "--dry-run"], exit_on_dry_run=False)
            s = tr.scaled(args, tr.trace(args))
            sizes.append(s.saved[s.kind("dense")])
        out["te" if impl == "transformer_engine" else "local"] = sizes[1] / sizes[0]
    return out
