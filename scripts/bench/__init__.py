"""Measurement helpers for the benchmark scripts and tests; the training runtime never imports this package."""


def fixed_width(cols: list[tuple[str, int]], rows: list[list]) -> list[str]:
    """A benchmark table's lines: the column names, then each row's values, right-aligned to the
    columns' widths."""
    return [" ".join(f"{str(v):>{w}}" for v, (_, w) in zip(row, cols)) for row in [[c for c, _ in cols], *rows]]
