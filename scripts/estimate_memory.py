"""Expected per-GPU memory of a recipe, from megatron's theoretical estimate
(megatron/training/theoretical_memory_usage.py), at the world size the recipe declares.

    .venv/bin/python scripts/estimate_memory.py recipes/cluster/*.yaml [--json]

Weights + gradients + optimizer state per GPU (the most loaded pipeline stage, the first), and
activations of the first pipeline stage with its in-flight micro-batches (megatron's formula from
Korthikanti et al. 2022, Table 2: it counts a dense MLP of --ffn-hidden-size per layer, so for MoE
layers it does not count the routed tokens' top-k expert activations or the dispatcher's buffers,
and it ignores our activation offload). Not measured on GPU.

How it differs from scripts/plan.py (the planner): this is megatron's closed-form estimate, its first
stage only, no schedule, dispatch buffers or offload; the planner traces the model itself, replays
megatron's schedule per stage and searches recompute / offload / layout (docs/planner.md).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json


from megatron_ext import errors, platform  # noqa: E402

GIB = 2**30


def estimate(recipe: str, extra: list[str] | None = None) -> dict:
    import arguments
    from megatron.training import theoretical_memory_usage as tmu

    extra = list(extra or [])
    # per-GPU memory: validated for the GPU platform (transformer-engine as the recipe pins it, else
    # assumed present; the estimate does not depend on it)
    target = [] if any(a.startswith(("--platform", "--assume")) for a in extra) else ["--platform", "cuda", "--assume-te"]
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse(["--recipe", recipe, "--dry-run", *target, *extra], exit_on_dry_run=False)
        micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        weights = tmu.compute_weight_and_optimizer_memory(args)
        if args.sequence_parallel and args.recompute_granularity == "selective":  # as report_theoretical_memory
            activations = tmu.compute_activation_memory(args, num_microbatches=micro_batches)
        else:
            activations = tmu.compute_activation_memory_without_sp(args, num_microbatches=micro_batches)
    return {
        "recipe": recipe,
        "world size": args.world_size,
        "layout": (
            f"TP{args.tensor_model_parallel_size} PP{args.pipeline_model_parallel_size}"
            + (f" VPP{args.virtual_pipeline_model_parallel_size}" if args.virtual_pipeline_model_parallel_size else "")
            + (f" EP{args.expert_model_parallel_size}" if args.expert_model_parallel_size > 1 else "")
            + f" DP{args.data_parallel_size}"
        ),
        "micro-batches": micro_batches,
        "weights+grads+optimizer GiB": weights / GIB,
        "activations GiB": activations / GIB,
        "total GiB": (weights + activations) / GIB,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    opts = parser.parse_args(argv)
    errors.quiet()  # third-party warnings that tell the user nothing (MEGATRON_EXT_VERBOSE=1 shows them)
    platform.setup()  # before megatron-core is imported (arguments)
    rows = [estimate(r) for r in opts.recipes]
    if opts.json:
        print(json.dumps(rows, indent=1))
        return
    cols = list(rows[0])
    cells = [[f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print(" | ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths)))


if __name__ == "__main__":
    main()
