"""The command that runs a planned configuration: torchrun on every node, the slurm template
(scripts/slurm/train.sbatch) with its variables, and the environment megatron needs there.

The train.py command line is the run's own (its recipe and the flags it was planned with, less the
planner's options and --dry-run's target flags) with the flags whose setting the configuration
changes replaced (``settings.changed``). Nodes: the world size over the GPUs per node. The
environment is ``megatron_ext.platform.target.launch_env`` for the planned GPU, the rule
scripts/slurm/launch_env.py applies inside the template. ``check`` (argv -> validated arguments)
parses the command back: a setting it does not reproduce is one the command line cannot switch off
(``--recompute-granularity`` has no "none"): the recipe key to remove is named.
"""
from __future__ import annotations

import shlex

from megatron_ext.planner import settings as st
from megatron_ext.planner.options import NAMES

SBATCH = "scripts/slurm/train.sbatch"
RDZV_PORT = 29500
HEAD_NODE = "$HEAD_NODE"  # the first node's address: the user's shell (or slurm) fills it in
# not the run's flags: the target a --dry-run validates for, the planner's own (the plan's command
# line spells them as train.py does: --plan, --plan-NAME) and --dry-run's
TARGET_FLAGS = ("--platform", "--assume-te", "--assume-no-te", "--assume-apex", "--target-gpu")
NOT_THE_RUNS = (*TARGET_FLAGS, "--plan", *("--plan-" + name for name in NAMES), "--dry-run", "--all", "--recipe")


def groups(argv: list) -> list:
    """The command line as [flag, its values...] groups (train.py takes no positional arguments)."""
    out: list = []
    for a in argv:
        if a.startswith("--") or not out:
            out.append([a])
        else:
            out[-1].append(a)
    return out


def _name(group: list) -> str:
    return group[0].partition("=")[0]


def split_argv(run_argv: list) -> tuple:
    """(recipe or None, the run's flags, the --dry-run target flags) of the planner's command line."""
    recipe, run, target = None, [], []
    for g in groups(run_argv):
        name = _name(g)
        if name == "--recipe":
            recipe = g[0].partition("=")[2] or (g[1] if len(g) > 1 else None)
        elif name in TARGET_FLAGS:
            target += g
        elif name not in NOT_THE_RUNS:
            run += g
    return recipe, run, target


def nodes_for(world: int, gpus_per_node: int) -> tuple:
    """(nodes, processes per node): whole nodes; a world that does not fill them evenly uses the
    largest divisor of it that a node holds."""
    if world <= gpus_per_node:
        return 1, world
    per_node = max(d for d in range(1, gpus_per_node + 1) if world % d == 0)
    return world // per_node, per_node


def _shell(words: list) -> str:
    return " ".join(w if HEAD_NODE in w else shlex.quote(w) for w in words)


def build(args, run_argv: list, given: dict, chosen: dict, gpu: str, gpus_per_node: int, check=None) -> dict:
    """The launch of the configuration ``chosen`` (settings) of the run ``args`` (parsed from
    ``run_argv``, the planner's ``cli.parse``; as given: ``given``), on ``gpu`` nodes of
    ``gpus_per_node``."""
    from megatron_ext.platform import target

    recipe, run, target_flags = split_argv(run_argv)
    changed = st.changed(given, chosen)
    kept = [w for g in groups(run) if _name(g) not in changed for w in g]
    flags = [*kept, *st.render(chosen, changed)]
    if args.transformer_impl == "local" and args.config_sources.get("transformer_impl") == "default":
        flags += ["--transformer-impl", "local"]  # planned without transformer-engine (--assume-no-te): keep it so
    train = ["train.py", *(["--recipe", recipe] if recipe else []), *flags]
    world = chosen["--world-size"]
    nodes, per_node = nodes_for(world, gpus_per_node)
    fsdp = bool(args.use_megatron_fsdp or args.use_torch_fsdp2)
    env = target.launch_env(tp=chosen["--tensor-model-parallel-size"], cp=args.context_parallel_size or 1,
                            fsdp=fsdp, arch=target.GPUS[gpu][0][0])
    rdzv = ["--nnodes", str(nodes), "--nproc-per-node", str(per_node)]
    if nodes > 1:
        rdzv += ["--rdzv-id", "megatron_ext", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{HEAD_NODE}:{RDZV_PORT}"]
    out = dict(world_size=world, nodes=nodes, gpus_per_node=per_node, env=env, train_flags=flags, train=train,
               torchrun=["torchrun", *rdzv, *train], sbatch=None, sbatch_env=None, recipe_changes=[], unexplained=[],
               checked=None, refused=None)
    if recipe:
        out["sbatch_env"] = {"RECIPE": recipe, "GPUS_PER_NODE": str(per_node)}
        out["sbatch"] = ["sbatch", f"--nodes={nodes}", f"--gpus-per-node={per_node}", SBATCH, *flags]
    if check is not None:
        from megatron_ext.errors import ConfigError

        try:
            _check(out, check([*train[1:], *target_flags]), chosen)
        except ConfigError as e:  # the command as printed would be refused: say so instead of hiding it
            out.update(checked=False, refused=str(e))
    return out


# a setting that only counts with its family's head (recompute granularity, offloaded modules)
_HEAD = {**{f: st.RECOMPUTE[0] for f in st.RECOMPUTE[1:]}, **{f: st.OFFLOAD[0] for f in st.OFFLOAD[1:]}}


def _check(out: dict, parsed, chosen: dict) -> None:
    """What the command line, parsed back, does not reproduce: the recipe keys to remove
    (``recipe_changes``) and anything else (``unexplained``: a bug of this module if ever seen)."""
    sources = parsed.config_sources
    wrong = st.changed(chosen, st.of_args(parsed))
    from_recipe = [f for f in wrong if sources.get(st.dest(f)) == "recipe"]
    out["recipe_changes"] = [st.dest(f) for f in from_recipe]
    out["unexplained"] = [f for f in wrong if f not in from_recipe and _HEAD.get(f) not in from_recipe]
    out["checked"] = not wrong


def as_json(launch: dict) -> dict:
    return dict(launch, torchrun_command=_shell(launch["torchrun"]), sbatch_command=sbatch_command(launch))


def sbatch_command(launch: dict) -> str | None:
    if not launch["sbatch"]:
        return None
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in launch["sbatch_env"].items()) + " " + _shell(launch["sbatch"])


def text(launch: dict, indent: str = "  ") -> str:
    """The launch as the table output prints it."""
    n, g = launch["nodes"], launch["gpus_per_node"]
    lines = [f"{launch['world_size']} GPUs = {n} node{'s' if n > 1 else ''} x {g}"]
    if launch["refused"]:
        lines.append(f"{indent}refused when parsed back (a bug of the planner; please report): {launch['refused']}")
    for key in launch["recipe_changes"]:
        lines.append(f"{indent}first remove `{key}` from the recipe (the command line cannot switch it off)")
    head = f"{indent}on every node" + (f" ({HEAD_NODE}: the first node's address)" if n > 1 else "") + ":"
    lines.append(head)
    for name, value in launch["env"].items():
        lines.append(f"{indent * 2}" + (f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}"))
    lines.append(f"{indent * 2}{_shell(launch['torchrun'])}")
    if launch["sbatch"]:
        lines.append(f"{indent}with slurm ({SBATCH}: one torchrun per node; it sets the environment itself):")
        lines.append(f"{indent * 2}{sbatch_command(launch)}")
    else:
        lines.append(f"{indent}with slurm: {SBATCH} needs a recipe (RECIPE); plan with --recipe")
    return "\n".join(lines)
