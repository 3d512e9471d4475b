"""The conversion's processes: this rank, a step whose refusal on any rank is every rank's, the layout
sizes its flags give, and progress on rank 0 (a 70B conversion takes minutes)."""
from __future__ import annotations

import os
import sys
import time

import torch

from megatron_ext.errors import ConfigError


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def agreed(step):
    """step() on every rank; a refusal on any rank is raised on every rank (the lowest rank's line),
    so no rank waits in a collective its peers never reach."""
    error, out = None, None
    try:
        out = step()
    except ConfigError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file on one rank must not leave the others waiting
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first)
    return out


def layout_flag(extra: list[str], name: str, default: int = 1) -> int:
    """A parallel size among layout flags given as a list (``--tensor-model-parallel-size 2``)."""
    return int(extra[extra.index(name) + 1]) if name in extra else default


class Progress:
    """Tensors done / total and the bytes per second, on stderr of rank 0, on a terminal (or with
    MEGATRON_EXT_PROGRESS=1)."""

    def __init__(self, total: int, desc: str):
        self.bar, self.bytes, self.t0 = None, 0, time.perf_counter()
        if int(os.environ.get("RANK", "0")) == 0 and (sys.stderr.isatty() or os.environ.get("MEGATRON_EXT_PROGRESS")):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bytes += nbytes
            rate = self.bytes / max(time.perf_counter() - self.t0, 1e-9) / 2**20
            self.bar.set_postfix_str(f"{self.bytes / 2**20:.0f} MiB, {rate:.0f} MiB/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
