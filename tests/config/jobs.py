"""Jobs for tests/config, run on every rank of a persistent gloo world (tests/dist.py)."""
from __future__ import annotations

import contextlib
import io


def train_records(argv: list[str]) -> list[dict]:
    """train.main(argv): every iteration's loss, learning rate and grad norm."""
    import train as entry

    with contextlib.redirect_stdout(io.StringIO()):
        history = entry.main(argv)
    return [{k: r.get(k) for k in ("lm loss", "learning rate", "grad norm")} for r in history]
