"""Builders for model / optimizer / data, the train step, logging; the run that composes them (run.py)
and the order the capabilities attach in (features.py). Checkpoints: megatron_ext/checkpoint.

The public entry for the packages above (hf, the planner): ``Run``, resolved on first use, so that
naming the package imports no megatron-core before the entry point sets the platform up."""


def __getattr__(name: str):
    if name == "Run":
        from megatron_ext.training.run import Run

        return Run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
