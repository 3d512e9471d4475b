"""The arguments a parse gives with no flag (megatron's, this project's, the planner's), with some set:
what a capability's checks receive, built without the parse's own checks."""
from __future__ import annotations

import argparse
import copy
import functools


@functools.lru_cache(maxsize=1)
def _defaults() -> tuple:
    import arguments

    return tuple(sorted(vars(arguments.build_parser().parse_args([])).items(), key=lambda kv: kv[0]))


def parsed_args(**values) -> argparse.Namespace:
    """Every flag's default, then ``values``."""
    return argparse.Namespace(**{**copy.deepcopy(dict(_defaults())), **values})
