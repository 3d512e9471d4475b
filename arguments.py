"""The run's flags: megatron's own, this project's, yours; a YAML recipe merged under the command line
(defaults < recipe < command line). Every entry point hands ``parse`` to the one bring-up, as Megatron-LM's
pretrain_gpt.py hands its extra_args_provider to pretrain:

    Run.from_argv(argv, parse=arguments.parse)    # train.py, scripts/*.py: the run parses with it
    args = arguments.parse(argv)                  # every flag checked before any compute; --dry-run exits here

A recipe is a YAML mapping whose keys are the flags' names (``num_layers`` or ``num-layers``). Unknown
keys and wrongly typed values are errors that name the key and suggest the closest valid one.

Add a flag of your own in ``add_arguments`` below; no module of megatron_ext imports this file, so what
you add reaches the package only as ``args.<dest>``, which every hook of megatron_ext/training/features.py
receives (CONTRIBUTING.md, Flags).
"""
from __future__ import annotations

import contextlib
import copy
import sys

from megatron.training.arguments import add_megatron_arguments

from megatron_ext import checkpoint
from megatron_ext.config import command_line
from megatron_ext.planner import options as planner_options
from megatron_ext.platform import target
from megatron_ext.training import features

USAGE = "torchrun --nproc-per-node N train.py --recipe YAML [--dry-run] [flags ...]   (one process: python train.py ...)"


def add_arguments(parser):
    """Your flags (Megatron-LM's extra_args_provider): declared once, with help text, they are recipe
    keys too and show under their group in --help. Read them as ``args.<dest>`` in a capability's hooks
    (megatron_ext/training/features.py); refuse a value there with
    ``megatron_ext.errors.ConfigError("--my-flag=value: what is allowed")``, before any compute. E.g.

        group = parser.add_argument_group("megatron_ext: my capability", "what it is for")
        group.add_argument("--my-flag", type=int, default=None, help="What it does.")
    """
    return parser


def _run_flags(parser) -> None:
    """The command line's own flags (megatron_ext/config/command_line.py reads them)."""
    group = parser.add_argument_group("megatron_ext")
    group.add_argument("--recipe", type=str, default=None, help="YAML recipe; its keys are flag names.")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate everything (building megatron's config objects, not the model), print what the "
        "recipe, the command line, the platform or megatron set, with each value's source, and exit.",
    )
    group.add_argument("--all", action="store_true", help="With --dry-run: print every value, defaults too.")
    group.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="Expected number of processes. --dry-run validates against it; a real run refuses to "
        "start if WORLD_SIZE differs. Default: WORLD_SIZE from the launcher (1 without one).",
    )
    group.add_argument(
        "--verbose",
        action="store_true",
        help="Show the third-party warnings that are filtered by default (deprecations inside torch and "
        "megatron-core: megatron_ext/errors.py QUIET_WARNINGS); also MEGATRON_EXT_VERBOSE=1.",
    )
    target.add_arguments(group)  # --platform, --assume-te / --assume-no-te: a --dry-run for another machine


_BUILT: list = []  # the parser as first built in this process
_LENT: list = []  # it, while a parse has set the recipe's values as its defaults


def _built():
    """Built once per process: megatron's add_megatron_arguments reads its config classes' source for
    their help texts, ~0.07 s a time, and a process that parses many times (the test workers, a
    refusal's explanation) paid it each time."""
    if not _BUILT:
        parser = command_line.Parser(
            prog="train.py", usage=USAGE, allow_abbrev=False,
            description="megatron_ext: Megatron-Core training. Below: this project's flags, then the common "
            "Megatron flags, then every other Megatron flag by megatron's groups (docs/flags.md: what each "
            "does here).")
        add_megatron_arguments(parser)  # megatron's flags, as pretrain_gpt.py parses them
        _run_flags(parser)
        features.add_arguments(parser)  # each capability package's flags
        planner_options.add_arguments(parser)  # --plan: train.py prints the plan instead of training
        add_arguments(parser)  # yours
        command_line.order_help(parser)
        _BUILT.append(parser)
    return _BUILT[0]


def build_parser():
    """A parser of its own for the caller, to change as it likes (a copy of the one built)."""
    return copy.deepcopy(_built())


@contextlib.contextmanager
def _lent_parser():
    """The built parser itself for one parse, which sets the recipe's values as its defaults: they are
    back to the built ones when the block ends (a copy costs more than the parse). A parse within a
    parse gets a copy."""
    parser = _built()
    if _LENT:
        yield copy.deepcopy(parser)
        return
    defaults, parser_defaults = {a: a.default for a in parser._actions}, dict(parser._defaults)
    _LENT.append(parser)
    try:
        yield parser
    finally:
        for action, default in defaults.items():
            action.default = default
        parser._defaults.clear()
        parser._defaults.update(parser_defaults)
        _LENT.clear()


def parse(argv: list[str] | None = None, *, exit_on_dry_run: bool = True, first_read=None):
    """The command line over the recipe over the defaults, every value checked before any compute
    (command_line.finalize); --dry-run prints the resolved values and exits (or returns them).
    ``first_read``: what a stage that read --load before the parse found (a conversion's; the run
    reads none of it again: megatron_ext/checkpoint/dirs.py FirstRead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with _lent_parser() as parser:
        return _parse(parser, argv, exit_on_dry_run, first_read)


def _parse(parser, argv: list[str], exit_on_dry_run: bool, first_read):
    known = parser.parse_known_args(argv)[0]
    # --recipe, else the recipe the --load checkpoint records (megatron_ext/checkpoint/recipe.py)
    recipe, recorded = command_line.recipe_values(known, parser, first_read)
    cli = command_line.explicit_cli_dests(parser, argv)
    parser.set_defaults(**recipe)  # the recipe's values become the defaults the command line overrides
    args = parser.parse_args(argv)
    for dest, value in vars(args).items():  # a default list is the parser's own object: the run gets a copy
        if isinstance(value, (list, dict, set)):
            setattr(args, dest, copy.copy(value))
    args.config_sources = {
        dest: "cli" if dest in cli else "recipe" if dest in recipe else "default" for dest in vars(args)
    }
    if recorded:
        args.recipe, args.config_sources["recipe"] = recorded, "recorded by the --load checkpoint"
    command_line.finalize(args, parser, first_read)
    if args.dry_run:
        command_line.print_config(args)
        if exit_on_dry_run:
            raise SystemExit(0)
    else:  # what each checkpoint the run saves records of it
        args.recorded_recipe = checkpoint.describe_recipe(args, parser)
    return args


def explain(exc: BaseException) -> str | None:
    """The one-line refusal for an exception megatron raised from a flag after parsing, or None
    (errors.run's explain at the entry points)."""
    with _lent_parser() as parser:
        return command_line.explain(exc, parser)
