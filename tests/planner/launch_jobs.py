"""Job for tests/planner/test_launch.py (one rank): plans of one tiny model sharing one set of traces
(the model never changes, only the world size, the split and the budget)."""
from __future__ import annotations

import contextlib
import io

GIB = 2**30
RECIPE = "recipes/tiny_dense.yaml"
# one attention head: no tensor parallelism divides it, so the split search traces TP1 only
MODEL = ["--recipe", RECIPE, "--num-attention-heads", "1", "--global-batch-size", "64"]
TWO_NODES = [*MODEL, "--world-size", "16", "--pipeline-model-parallel-size", "2", "--gpus-per-node", "8"]


def _parse(argv):
    import arguments

    with contextlib.redirect_stdout(io.StringIO()):
        return arguments.parse([*argv, "--dry-run"], exit_on_dry_run=False)


@contextlib.contextmanager
def _recipe(**extra):
    """recipes/tiny_dense.yaml with ``extra`` keys, as a temporary file."""
    import os
    import tempfile

    import yaml

    with open(RECIPE) as f:
        keys = dict(yaml.safe_load(f), **extra)
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(keys, f)
    try:
        yield path
    finally:
        os.unlink(path)


def _plan(argv, tracer):
    import arguments
    from megatron_ext.planner import cli

    return cli.run(argv, "--", arguments.parse, refuse=False, tracer=tracer)[1:]


def _twins(rows) -> list:
    """Rows whose predictions (split, every stage's peak, step time) equal another row's: the only
    ones that can be the same configuration."""
    seen: dict = {}
    for r in rows:
        seen.setdefault((r.layout, tuple(r.peak_bytes_per_stage), r.step_time_s), []).append(r)
    return [r for group in seen.values() if len(group) > 1 for r in group]


def plans():
    from megatron_ext.planner import cli, launch, search, settings

    import arguments

    tracer = search.Tracer()
    out = {}

    # a winner that changes the run, on two nodes: a budget just below the run as given
    free, _ = _plan([*TWO_NODES, "--memory-gb", "1", "--top", "1000"], tracer)
    given = free["given_settings"]
    budget = (free["as_given"].peak - 1) / GIB
    result, report = _plan([*TWO_NODES, "--memory-gb", repr(budget)], tracer)
    winner, lch = result["candidates"][0], result["launch"]
    parsed = _parse([*lch["train"][1:], "--platform", "cuda", "--assume-te"])
    # the model with its four heads on TP2 and the winner's recompute / offload (a launch needs no
    # trace): the environment TP asks for, per GPU generation
    _, args, run_argv = cli.parse([a for a in TWO_NODES if a not in ("--num-attention-heads", "1")], "--",
                                  arguments.parse)
    four_heads = settings.of_args(args)
    tp2 = dict(four_heads, **{f: winner.settings[f] for f in (*settings.RECOMPUTE, *settings.OFFLOAD)},
               **{"--tensor-model-parallel-size": 2, "--sequence-parallel": True})
    check = cli.reparse(arguments.parse)
    out["launch"] = dict(
        given=given, winner_flags=winner.flags, winner_fits=winner.fits, winner_as_given=winner.as_given,
        winner_settings=winner.settings, launch=lch, json=report["launch"], parsed=settings.of_args(parsed),
        tp2_h100=launch.build(args, run_argv, four_heads, tp2, "h100", 8, check=check),
        tp2_b200=launch.build(args, run_argv, four_heads, tp2, "b200", 8),
        odd_world=launch.nodes_for(12, 8), small_world=launch.nodes_for(4, 8))

    # recompute switched off where the run asks for it: on the command line (dropped from it) or in
    # the recipe (the command line cannot unset it: the key to remove is named)
    out["switch_off"] = {}
    for where in ("cli", "recipe"):
        with _recipe(recompute_granularity="selective") if where == "recipe" else contextlib.nullcontext(RECIPE) as r:
            argv = ["--recipe", r, *TWO_NODES[2:], *(["--recompute-granularity", "selective"] if where == "cli" else [])]
            _, a, a_argv = cli.parse(argv, "--", arguments.parse)
            own = settings.of_args(a)
            off = dict(own, **settings.recompute_choice("none"))
            out["switch_off"][where] = dict(given=own, launch=launch.build(a, a_argv, own, off, "h100", 8, check=check))

    # nothing fits: the budget just below the lowest peak of every candidate at this world size
    lowest = min(c.peak for c in free["candidates"])
    tight = (lowest - 1) / GIB
    result, report = _plan([*TWO_NODES, "--memory-gb", repr(tight), "--top", "1000"], tracer)
    more = next((c for c in result["nearest"] if c.kind == "more GPUs"), None)
    replanned = None
    if more is not None:  # the hint's own command, planned as given
        again, _ = _plan([*more.launch["train"][1:], "--gpus-per-node", "8", "--memory-gb", repr(tight)], tracer)
        replanned = dict(peak=again["as_given"].peak, fits=again["as_given"].fits, layout=again["layout"])
    out["nothing_fits"] = dict(
        budget=result["budget_bytes"], refusal=result["refusal"], nearest=report["nearest"],
        peaks={settings.key(c.settings): c.peak for c in free["candidates"]},
        nearest_keys=[settings.key(c.settings) for c in result["nearest"]], replanned=replanned)

    # duplicates: the split search at world size 2 reaches the run's own split (TP1 PP1 DP2 mbs2)
    result, _ = _plan([*MODEL, "--world-size", "2", "--search-parallelism", "--memory-gb", "1", "--top", "1000"], tracer)
    rows = result["candidates"]
    _, _, run_argv = cli.parse([*MODEL, "--world-size", "2"], "--", arguments.parse)
    twins = _twins(rows)
    out["duplicates"] = dict(
        rows=[(r.as_given, r.layout, r.flags) for r in rows],
        as_given_rows=sum(r.as_given for r in rows),
        # what each twin's command line (the run's, then the row's flags) parses to
        twins=[(r.layout, r.flags, settings.key(settings.of_args(_parse([*run_argv, *r.flags])))) for r in twins])
    return out
