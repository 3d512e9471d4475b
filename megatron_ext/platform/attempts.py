"""Which attempt of the job this process belongs to (torchrun --max-restarts, slurm requeues): the
restart count and the key prefix every key of this attempt is written under (platform.init_distributed)."""
from __future__ import annotations

import os


def restart_count() -> int:
    """How many times this job was restarted: torchrun's TORCHELASTIC_RESTART_COUNT (--max-restarts)
    plus slurm's SLURM_RESTART_COUNT (a requeued job); 0 on a first start."""
    return sum(int(os.environ.get(name) or 0) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def store_prefix() -> str:
    """The key prefix of this attempt in the job's key-value store (platform.init_distributed)."""
    return f"megatron_ext/attempt_{os.environ.get('SLURM_RESTART_COUNT') or 0}.{os.environ.get('TORCHELASTIC_RESTART_COUNT') or 0}"
