"""Refusals: a bad flag reaches the user as one line, printed once, with a non-zero exit."""
from __future__ import annotations

import os
import sys
from typing import Callable

# Set to 1 to keep the traceback of a refusal (debugging megatron_ext itself).
TRACEBACK_ENV = "MEGATRON_EXT_TRACEBACK"


class ConfigError(ValueError):
    """A bad flag or recipe value, reported before any compute starts.
    The message names the flag (``--flag-name=value``) and what is wrong."""


class InputError(Exception):
    """A file a tool reads is not what it expects (a line that is not JSON, a key holding no text);
    the message names the file and line. Defined here, importable, so it crosses process pools."""


def run(main: Callable[[], object], explain: Callable[[BaseException], str | None]) -> None:
    """Call ``main``; a ConfigError, or an error megatron raised from a flag (``explain`` names the
    flags, or returns None for anything else, which keeps its traceback), becomes ``error: LINE`` on
    rank 0's stderr and exit status 1 on every rank: the ranks refuse the same flags, so one line."""
    try:
        main()
    except (AssertionError, ValueError, RuntimeError, NotImplementedError) as e:
        line = explain(e)
        if line is None or os.environ.get(TRACEBACK_ENV) == "1":
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(1)
