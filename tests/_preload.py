"""Imported once by the worker pools' fork server (tests/dist.py): every worker forked from it
starts with torch, megatron-core and the entry points already imported (scripts/bench/preload.py)."""
from bench import preload

preload.imports()

import megatron_ext.schedules.overlap_1f1b  # noqa: E402,F401

preload.freeze()
