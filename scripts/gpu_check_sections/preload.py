"""Imported once by the fork server of ``scripts/gpu_check.py`` without CUDA: every section's process
forked from it starts with torch, megatron-core (scripts/bench/preload.py) and the sections already
imported. Never used with CUDA: there each section is a fresh interpreter."""
from bench import preload

preload.imports()

import gpu_check_sections  # noqa: E402,F401

preload.freeze()
