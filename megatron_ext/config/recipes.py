"""YAML recipes: a mapping whose keys are the flags' names (the dest ``num_layers`` or the flag's own
spelling ``disable_bias_linear``), read through the same parser actions as the command line, so a key
and its flag accept the same values. Unknown keys and wrongly typed values are errors that name the
key and suggest the closest valid one."""
from __future__ import annotations

import argparse
import difflib
import os

import yaml

from megatron_ext.errors import ConfigError
from megatron_ext.platform import target


def parser_actions(parser) -> dict:
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


def read(path: str) -> dict:
    """The recipe's mapping as the file holds it (one-line refusals: no file, not YAML, not a mapping)."""
    if not os.path.exists(path):
        raise ConfigError(f"--recipe={path}: no such file")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:  # one line: where the YAML breaks, not the parser's traceback
            mark = getattr(e, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"--recipe={path}: not valid YAML at{where}: {what}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--recipe={path}: a recipe is a mapping of flag names to values")
    return raw


def resolve(raw: dict, parser, path: str) -> dict:
    """A recipe's mapping (:func:`read`) through the parser's actions: dest -> value; every unknown key
    or wrongly typed value refused at once, naming ``path``."""
    actions, options = parser_actions(parser), _option_names(parser)
    resolved, problems = {}, []
    for key, value in raw.items():  # every key on its own: all the recipe's problems are reported at once
        try:
            resolved.update(_resolve(key, value, actions, options, path))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return resolved


def _resolve(key, value, actions: dict, options: dict, path: str) -> dict:
    name = str(key).replace("-", "_")
    if name in ("recipe", "dry_run", "all", *target.CLI_ONLY) or (name not in actions and name not in options):
        close = difflib.get_close_matches(name, [*actions, *options], n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{path}: unknown key '{key}'{hint}")
    if name in actions:
        return {name: _coerce(key, value, actions[name], path)}
    action = options[name]  # the flag's own spelling: `disable_bias_linear: true` means the flag is given
    given = _coerce(key, value, action, path)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return {action.dest: action.const if given else action.default}
    return {action.dest: given}
