"""How a refusal names flags and values: ``--flag=value`` for each dest, by the parser's spelling."""
from __future__ import annotations

import argparse
from typing import Callable


def flag_of(parser_actions: dict, dest: str) -> str:
    action = parser_actions.get(dest)
    if action is None:
        return "--" + dest.replace("_", "-")
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0] if longs else dest


def show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def name_of(parser_actions: dict, dest: str) -> str:
    """The name a refusal shows: the flag, except for a store_false flag (``--no-rope-fusion``),
    shown by its dest (``apply_rope_fusion``, the recipe key) since the flag means the opposite."""
    if isinstance(parser_actions.get(dest), argparse._StoreFalseAction):
        return dest
    return flag_of(parser_actions, dest)


def describe(args, dests, names: Callable[[str], str]) -> str:
    """``--flag=value`` for each dest."""
    return ", ".join(f"{names(d)}={show(getattr(args, d, None))}" for d in dests)
