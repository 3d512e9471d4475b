"""Job functions for tests/training/test_sharded_params.py (run on every rank of a gloo world)."""
from __future__ import annotations

RECIPE = "recipes/tiny_moe_many_experts.yaml"


def gather_counts(experts: int, seams: bool = True, defaults: bool = False, extra=()) -> dict:
    """One measured train.main run (1 warm-up + 1 counted + 1 timed iteration) of the many-experts
    recipe with E experts on DP2/EP2. defaults=True: megatron-core's DDP defaults instead of the
    recipe's (distributed optimizer, no overlap, one bucket per buffer)."""
    from bench import gather

    argv = ["--recipe", RECIPE, "--num-experts", str(experts), "--expert-model-parallel-size", "2",
            "--seq-length", "32", "--max-position-embeddings", "32", *extra]
    r = gather.measure(argv, counted_steps=1, timed_steps=1, seams=seams, ddp_defaults=defaults)
    r.pop("sync_op_names", None)
    return r
