"""Sharded-parameter gather / reduce path of the distributed optimizer, as a function of the number
of experts.

    .venv/bin/python scripts/bench_gather.py [--experts 8 32 128] [--json]
    .venv/bin/python scripts/bench_gather.py --smoke [--json]     # E = 4 alone: seconds (the suite's run)

Runs train.py's main() (recipes/tiny_moe_many_experts.yaml, --num-experts E) on a 2-process gloo
world (DP2 / EP2) under scripts/bench/gather.measure, and the same model with megatron-core's
defaults side by side:

  mcore-default   --use-distributed-optimizer only (megatron's flag defaults: no overlap, one bucket
                  per buffer), megatron-core's code (our seams removed)
  mcore-overlap   + --overlap-grad-reduce --overlap-param-gather, megatron's default bucket size
                  (max(40M, 1M x DP) elements), megatron-core's code
  ours            the recipe as is (overlap + --ddp-num-buckets) with the sharded-parameter seams

Per step (one counted step after a warm-up; host time = best of 3 uncounted steps):
  collectives_per_step  c10d collectives dispatched inside the bucket-group methods (param all-gather,
                        grad reduce-scatter; megatron coalesces each bucket group's into one)
  host_ops_per_step     aten ops dispatched in that path (incl. DDP's forward pre-hooks)
  host_syncs_per_step   aten._local_scalar_dense in that path (.item(): a device sync on a GPU)
  bucket_calls          top-level calls into megatron's bucket-group methods
  host_ms               this thread's CPU time in that path (host-side work, waits excluded)
  optim_ops             aten ops in optimizer.step() outside that path (for reference)
  init_s                the run's build (GPTModel + DDP buffers); ddp_init_ops / copies: the flattening
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import fixed_width  # noqa: E402
from bench.gather import measure  # noqa: E402
from megatron_ext.measure.launch import run_world  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "tiny_moe_many_experts.yaml")
DDP_KEYS = ("overlap_grad_reduce", "overlap_param_gather", "ddp_num_buckets", "ddp_bucket_size",
            "overlap_param_gather_with_optimizer_step", "ddp_average_in_collective")
DEVICE = "cpu (2 cores), gloo, 2 processes: not measured on GPU"


def defaults_recipe(tmpdir: str) -> str:
    """The same model with the DDP keys of our recipe removed (megatron-core's defaults)."""
    import yaml

    with open(RECIPE) as f:
        recipe = yaml.safe_load(f)
    for key in DDP_KEYS:
        recipe.pop(key, None)
    recipe["use_distributed_optimizer"] = True
    path = os.path.join(tmpdir, "tiny_moe_many_experts_mcore_defaults.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe, f)
    return path


def configs(tmpdir: str, num_buckets: int | None = None) -> dict:
    base = defaults_recipe(tmpdir)
    ours = ["--recipe", RECIPE] + (["--ddp-num-buckets", str(num_buckets)] if num_buckets else [])
    return {
        "mcore-default": (["--recipe", base], False),
        "mcore-overlap": (["--recipe", base, "--overlap-grad-reduce", "--overlap-param-gather"], False),
        "ours": (ours, True),
    }


def run_case(world_size: int, argv: list, seams: bool, experts: int, ep: int) -> dict:
    argv = argv + ["--num-experts", str(experts), "--expert-model-parallel-size", str(ep)]
    per_rank = run_world(world_size, measure, timeout=600, argv=argv, seams=seams)
    r0 = per_rank[0]
    worst = lambda k: max(r[k] for r in per_rank)  # noqa: E731
    return {
        "experts": experts,
        "params": r0["global_params"],
        "param_tensors_per_rank": r0["buffers"]["param_tensors"],
        "param_bytes_per_rank": r0["buffers"]["param_bytes"],
        "buckets_per_rank": r0["buffers"]["buckets"],
        "params_are_buffer_views": all(
            r["buffers"]["param_views"] == r["buffers"]["param_tensors"] == r["buffers"]["grad_views"] for r in per_rank
        ),
        "collectives_per_step": worst("collectives_per_step"),
        "host_ops_per_step": worst("host_ops_per_step"),
        "host_syncs_per_step": worst("host_syncs_per_step"),
        "bucket_calls_per_step": worst("sync_calls_per_step"),
        "host_s_per_step": worst("host_s_per_step"),
        "path_wall_s_per_step": worst("path_wall_s_per_step"),
        "step_s": worst("step_s"),
        "optimizer_ops_per_step": worst("optimizer_ops_per_step"),
        "step_collectives": worst("step_collectives"),
        "init_s": worst("init_s"),
        "ddp_init_s": worst("ddp_init_s"),
        "ddp_init_ops": worst("ddp_init_ops"),
        "ddp_init_copies": worst("ddp_init_copies"),
        "sync_op_names": r0["sync_op_names"],
        "losses": r0["losses"],
    }


def run(experts: list, world_size: int = 2, ep: int = 2, num_buckets: int | None = None, which=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfgs = configs(tmp, num_buckets)
        out = {"device": DEVICE, "world_size": world_size, "expert_model_parallel_size": ep, "recipe": RECIPE}
        results = {}
        for name, (argv, seams) in cfgs.items():
            if which and name not in which:
                continue
            results[name] = [run_case(world_size, argv, seams, e, ep) for e in experts]
    out["cases"] = results.get("ours", [])
    out["baselines"] = {k: v for k, v in results.items() if k != "ours"}
    return out


def table(out: dict) -> str:
    cols = [("config", 14), ("E", 4), ("params", 8), ("tensors", 7), ("buckets", 7), ("coll/step", 9),
            ("ops/step", 8), ("syncs", 5), ("calls", 5), ("host_ms", 7), ("wall_ms", 7), ("optim_ops", 9),
            ("init_s", 6), ("ddp_copies", 10)]
    rows = []
    groups = dict(out["baselines"])
    groups["ours"] = out["cases"]
    for name, cases in groups.items():
        for c in cases:
            rows.append([name, c["experts"], c["params"], c["param_tensors_per_rank"], c["buckets_per_rank"],
                   c["collectives_per_step"], c["host_ops_per_step"], c["host_syncs_per_step"],
                   c["bucket_calls_per_step"], f"{c['host_s_per_step'] * 1e3:.2f}",
                   f"{c['path_wall_s_per_step'] * 1e3:.2f}", c["optimizer_ops_per_step"], f"{c['init_s']:.3f}",
                   c["ddp_init_copies"]])
    lines = fixed_width(cols, rows)
    lines.append(f"device: {out['device']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--ep", type=int, default=2, help="expert-model-parallel size (world size 2)")
    p.add_argument("--num-buckets", type=int, default=None, help="override the recipe's ddp_num_buckets")
    p.add_argument("--configs", nargs="+", default=None, choices=["mcore-default", "mcore-overlap", "ours"])
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="seconds: E = 4 alone")
    a = p.parse_args(argv)
    if a.smoke:
        a.experts = [4]
    out = run(a.experts, ep=a.ep, num_buckets=a.num_buckets, which=a.configs)  # workers log to stderr
    if a.json:
        for group in [out["cases"], *out["baselines"].values()]:
            for c in group:
                c.pop("sync_op_names", None)
                c.pop("losses", None)
        print(json.dumps(out, indent=1))
    else:
        print(table(out))


if __name__ == "__main__":
    main()
