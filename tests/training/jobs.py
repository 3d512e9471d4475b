"""Job functions run on every rank of a persistent gloo world (see tests/dist.py)."""
from __future__ import annotations


def train(argv: list[str]) -> list[dict]:
    import train as entry

    return entry.main(argv)
