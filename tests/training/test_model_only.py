"""The run's model-only bring-up (megatron_ext/training/run.py Run.for_model): a model from its flags
alone, in the world the platform sets up, with no optimizer, data or loop."""
from __future__ import annotations

import arguments
from tests.dist import run_distributed

STAND_INS = ("lr", "min_lr", "lr_warmup_iters", "mock_data", "train_iters", "micro_batch_size", "global_batch_size",
             "num_workers")


def _model_only(argv: list) -> dict:
    """Job: a model-only run of argv; what it built and what each training stage answered."""
    from megatron_ext.training.run import Run

    with Run.for_model(argv, parse=arguments.parse) as run:
        chunks = run.build()
        refused = {}
        for stage in ("optimize", "data", "step", "train"):
            try:
                getattr(run, stage)()
                refused[stage] = None
            except RuntimeError as e:
                refused[stage] = str(e)
        return {"chunks": [type(c).__name__ for c in chunks], "refused": refused,
                "recorded_run": sorted(run.args.recorded_recipe["run"]),
                "sources": {dest: run.args.config_sources[dest] for dest in STAND_INS},
                "lr": run.args.lr, "seq_length": run.args.seq_length}


def test_model_only_run_builds_the_bare_model_and_has_no_training_stages():
    """A training recipe (data, schedule, batch sizes) opens as its model: the bare chunks, no data-parallel
    wrapper; the optimizer, data, step and loop refuse by name; megatron's training values stand in and
    are recorded nowhere, while the caller's flags win (--seq-length)."""
    out = run_distributed(1, "tests.training.test_model_only:_model_only",
                          argv=["--recipe", "recipes/tiny_dense.yaml", "--seq-length", "32"])[0]
    assert out["chunks"] == ["GPTModel"], out
    assert set(out["refused"]) == {"optimize", "data", "step", "train"}
    assert all(why and why.startswith("a model-only run (Run.for_model) has no ") for why in out["refused"].values()), out
    assert out["refused"]["data"].endswith("has no data") and out["refused"]["train"].endswith("has no optimizer")
    assert not set(STAND_INS) & set(out["recorded_run"]), out["recorded_run"]
    assert set(out["sources"].values()) == {"model-only run (not read)"}, out["sources"]
    assert out["lr"] == 0.0 and out["seq_length"] == 32
