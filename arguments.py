"""Megatron's own flags + megatron_ext's flags + YAML recipes, resolved as defaults < recipe < cli.

    args = arguments.parse(argv)      # validates everything before any compute; --dry-run exits here

A recipe is a YAML mapping whose keys are the flags' names (``num_layers`` or ``num-layers``).
Unknown keys and wrongly typed values are errors that name the key and suggest the closest valid one.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys

import yaml

from megatron.training.arguments import add_megatron_arguments, validate_args

from megatron_ext.errors import ConfigError
from megatron_ext.platform import target
from megatron_ext.training import features

SOURCES = ("default", "recipe", "cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py", description="megatron_ext: Megatron-Core training", allow_abbrev=False
    )
    add_megatron_arguments(parser)
    group = parser.add_argument_group("megatron_ext")
    group.add_argument("--recipe", type=str, default=None, help="YAML recipe; its keys are flag names.")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Validate everything, print the resolved configuration with each value's source, exit.",
    )
    group.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="Expected number of processes. --dry-run validates against it; a real run refuses to "
        "start if WORLD_SIZE differs. Default: WORLD_SIZE from the launcher (1 without one).",
    )
    target.add_arguments(group)
    features.add_arguments(parser)
    for action in parser._actions:  # a few megatron help strings carry a bare '%', which breaks --help
        if action.help:
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    return parser


def _actions(parser) -> dict:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)}


def _option_names(parser) -> dict:
    """Recipe keys spelled as the flag (``disable_bias_linear``) where that differs from the dest."""
    names = {}
    for a in parser._actions:
        for opt in a.option_strings:
            key = opt.lstrip("-").replace("-", "_")
            if opt.startswith("--") and key != a.dest:
                names[key] = a
    return names


def _explicit_cli_dests(parser, argv) -> set:
    """The dests the command line set, found by parsing with every default suppressed."""
    saved = {a: a.default for a in parser._actions}
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, d in saved.items():
            a.default = d


def _flag(action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0] if longs else action.dest


def _coerce(key: str, value, action, where: str):
    flag = _flag(action)

    def bad(expected: str):
        return ConfigError(f"{where}: key '{key}' ({flag}) expects {expected}, got {value!r}")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if value is None:
            return None
        if not isinstance(value, list):
            value = [value]
        return [_coerce_one(v, action, bad) for v in value]
    if value is None:
        return None
    return _coerce_one(value, action, bad)


def _coerce_one(value, action, bad):
    kind = action.type
    if isinstance(value, (dict, list)):
        raise bad("a single value")
    if kind in (int, float) and isinstance(value, bool):
        raise bad(kind.__name__)
    if kind is int and isinstance(value, float):
        raise bad("int")
    if kind is not None:
        try:
            value = kind(value) if isinstance(value, str) or kind in (int, float) else kind(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            raise bad(getattr(kind, "__name__", "a valid value")) from None
    elif not isinstance(value, (str, int, float)):
        raise bad("a scalar")
    if action.choices is not None and value not in action.choices:
        raise bad(f"one of {sorted(map(str, action.choices))}")
    return value


def load_recipe(path: str, parser) -> dict:
    if not os.path.exists(path):
        raise ConfigError(f"--recipe={path}: no such file")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--recipe={path}: a recipe is a mapping of flag names to values")
    actions, options = _actions(parser), _option_names(parser)
    resolved = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in ("recipe", "dry_run", *target.CLI_ONLY) or (name not in actions and name not in options):
            close = difflib.get_close_matches(name, [*actions, *options], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{path}: unknown key '{key}'{hint}")
        if name in actions:
            dest, action = name, actions[name]
            resolved[dest] = _coerce(key, value, action, path)
        else:  # the flag's own spelling: `disable_bias_linear: true` means the flag is given
            action = options[name]
            given = _coerce(key, value, action, path)
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                resolved[action.dest] = action.const if given else action.default
            else:
                resolved[action.dest] = given
    return resolved


def parse(argv: list[str] | None = None, *, exit_on_dry_run: bool = True) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    recipe_path = parser.parse_known_args(argv)[0].recipe
    recipe = load_recipe(recipe_path, parser) if recipe_path else {}
    cli = _explicit_cli_dests(parser, argv)
    parser.set_defaults(**recipe)
    args = parser.parse_args(argv)
    args.config_sources = {
        dest: "cli" if dest in cli else "recipe" if dest in recipe else "default" for dest in vars(args)
    }
    finalize(args)
    if args.dry_run:
        print_config(args)
        if exit_on_dry_run:
            raise SystemExit(0)
    return args


def _fit_defaults_to_platform(args) -> None:
    """Platform-dependent defaults (transformer-engine, fusions, norms) for the machine this runs on
    or the --platform target of a --dry-run: megatron_ext/platform/target.py."""
    target.fit_defaults(args)


def _one_data_source(args) -> None:
    """--mock-data and --data-path are alternatives: the one given at higher precedence wins."""
    rank = {"default": 0, "recipe": 1, "cli": 2}
    mock, path = rank[args.config_sources["mock_data"]], rank[args.config_sources["data_path"]]
    if args.mock_data and args.data_path and mock != path:
        if mock > path:
            args.data_path, args.config_sources["data_path"] = None, "cleared by --mock-data"
        else:
            args.mock_data, args.config_sources["mock_data"] = False, "cleared by --data-path"


def finalize(args) -> None:
    """Everything megatron's validate_args checks, plus ours, before any compute starts."""
    launcher_world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.world_size is None:
        args.world_size = launcher_world
    elif not args.dry_run and args.world_size != launcher_world:
        raise ConfigError(
            f"--world-size={args.world_size}: the launcher started {launcher_world} processes"
        )
    args.rank = int(os.environ.get("RANK", "0"))
    _fit_defaults_to_platform(args)
    _one_data_source(args)
    if not args.mock_data and not args.data_path:
        raise ConfigError("no training data: give --data-path PREFIX (see scripts/prepare_data.py) or --mock-data")
    if args.train_iters is None:
        raise ConfigError("--train-iters is required (sample-based training is not supported)")
    decay = args.lr_decay_iters or args.train_iters
    warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else args.lr_warmup_iters
    if decay and warmup >= decay:
        raise ConfigError(
            f"--lr-warmup-iters={args.lr_warmup_iters} (or --lr-warmup-fraction) must be below the decay "
            f"length {decay} (--lr-decay-iters, else --train-iters)"
        )
    world_size_holder = args.world_size
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args dumps every argument on rank 0
        try:
            validate_args(args)
        except AssertionError as e:
            raise ConfigError(f"invalid configuration: {e}") from None
    args.world_size = world_size_holder
    from megatron_ext.training.data import padded_vocab_size

    if args.vocab_size is None:
        raise ConfigError("--vocab-size is required (257 for the byte-level data of scripts/prepare_data.py)")
    args.padded_vocab_size = padded_vocab_size(args)
    features.validate(args)


def print_config(args) -> None:
    width = max(len(k) for k in vars(args))
    print("resolved configuration (value  [source]):")
    for key in sorted(vars(args)):
        if key == "config_sources":
            continue
        print(f"  {key:<{width}} {getattr(args, key)!r}  [{args.config_sources.get(key, 'derived')}]")
