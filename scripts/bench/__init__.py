"""Measurement helpers for the benchmark scripts and tests; the training runtime never imports this package."""


def fixed_width(cols: list[tuple[str, int]], rows: list[list]) -> list[str]:
    """A benchmark table's lines: the column names, then each row's values, right-aligned to the
    columns' widths."""
    return [" ".join(f"{str(v):>{w}}" for v, (_, w) in zip(row, cols)) for row in [[c for c, _ in cols], *rows]]


# megatron's unfused kernels on every machine, as the benchmarks' hand-made configs had them (and no fused
# gradient accumulation: the benchmarks' models have no data-parallel wrapper to give weights a main_grad)
UNFUSED = ["--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion", "--no-bias-gelu-fusion",
           "--no-bias-swiglu-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]
