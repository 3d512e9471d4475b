"""Job functions of the transformer-engine name tests (tests/hf/test_te_names.py), run on a gloo world
of tests/dist.py."""
from __future__ import annotations

import contextlib
import io
import os

import arguments

MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "deepseek_v2_lite", "kimi_k2", "gpt_oss", "llama4_text")


def imports(hf_dirs: dict, root: str) -> dict:
    """One rank: each family's HF directory ({family: directory}, tests/hf/models.py make) imported
    under `root`; {family: checkpoint}."""
    from megatron_ext import hf

    out = {}
    for family, hf_dir in hf_dirs.items():
        out[family] = os.path.join(root, f"{family}_ckpt")
        with contextlib.redirect_stdout(io.StringIO()):
            hf.import_hf(hf_dir, out[family], parse=arguments.parse)
    return out


def parse(recipe: str, *flags: str):
    """The arguments of `recipe` as a --dry-run validates them (the checkpoint under --load checked
    against the run's whole model: training/run.py check_load), without exiting."""
    from megatron_ext.training.run import Run

    with contextlib.redirect_stdout(io.StringIO()):
        return Run.from_argv(["--recipe", recipe, "--mock-data", "--num-workers", "0", "--lr", "1e-5",
                              "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
                              "--finetune", "--dry-run", *flags], exit_on_dry_run=False, parse=arguments.parse).args


def through(args, save: str) -> list:
    """Load --load into this run's whole model (a model-only run on CPU; transformer-engine's spec with the
    stand-ins), save it under `save`; the model's state-dict names."""
    from megatron_ext.checkpoint import keys as checkpoint_keys
    from megatron_ext.training.run import Run

    whole = checkpoint_keys.whole_model_args(args)
    whole.save, whole.save_interval, whole.dry_run, whole.no_save_optim, whole.no_save_rng = save, 1, False, True, True
    with Run(whole, model_only=True) as run, contextlib.redirect_stdout(io.StringIO()):
        (chunk,) = run.build()
        run.load(weights_only=True)
        run.save(0, weights_only=True)
        return sorted(chunk.state_dict())


def _tensors(ckpt: str) -> dict:
    """A checkpoint's tensors by storage key, as numpy arrays (a job's torch tensors would travel
    through shared memory)."""
    import torch
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    loaded = load_plain_tensors(os.path.join(ckpt, "iter_0000000"))
    return {k: v.numpy() for k, v in loaded.items() if torch.is_tensor(v)}


def round_trip(hf_dirs: dict, root: str) -> dict:
    """Each family's import (local names) loaded into the transformer-engine spec (--moe-grouped-gemm
    for MoE: TEGroupedMLP) and saved, that loaded into the local spec and saved: per family, the three
    checkpoints' tensors by storage key, the transformer-engine model's state and what each dry-run
    reported."""
    out = {}
    for family, ckpt in imports(hf_dirs, root).items():
        recipe = os.path.join(ckpt, "recipe.yaml")
        te_dir, back_dir = os.path.join(root, f"{family}_te"), os.path.join(root, f"{family}_back")
        grouped = ["--moe-grouped-gemm"] if family in MOE else []
        te_args = parse(recipe, "--load", ckpt, "--platform", "cuda", "--assume-te", *grouped)
        te_state = through(te_args, te_dir)
        local_args = parse(recipe, "--load", te_dir, "--transformer-impl", "local")
        through(local_args, back_dir)
        out[family] = dict(
            imported=_tensors(ckpt), te=_tensors(te_dir), back=_tensors(back_dir), te_model_names=te_state,
            te_spec=te_args.transformer_impl, te_report=te_args.checkpoint_keys, back_report=local_args.checkpoint_keys)
    return out


def finetune(recipe: str, load: str, save: str, layout: list, world: int) -> list:
    """3 iterations of --finetune from `load` on `layout`, saved under `save`: each iteration's loss."""
    import train as entry

    argv = ["--recipe", recipe, "--load", load, "--finetune", "--save", save, "--save-interval", "3", "--mock-data",
            "--num-workers", "0", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "3", "--lr", "1e-2", "--world-size", str(world), "--log-interval", "1",
            "--eval-iters", "0", *layout]
    with contextlib.redirect_stdout(io.StringIO()):
        history = entry.main(argv)
    return [(h["iteration"], h["lm loss"]) for h in history]


def finetune_and_forward(recipe: str, load: str, save: str, layout: list, world: int, ids: list) -> dict:
    """Every rank: the 3-iteration fine-tune, then our forward's logits of its checkpoint under the
    same layout (rank 0's)."""
    from megatron_ext import hf

    losses = finetune(recipe, load, save, layout, world)
    ours = hf.logits(save, ids, recipe=recipe, extra=layout, parse=arguments.parse)
    return dict(losses=losses, ours=None if ours is None else ours.numpy())


def one_process(recipe: str, load: str, save: str, ids: list, exports: dict) -> dict:
    """One rank: the 3-iteration fine-tune and our forward on one process, then the export of each
    checkpoint in `exports` ({run directory: HF directory to write})."""
    from megatron_ext import hf

    out = finetune_and_forward(recipe, load, save, [], 1, ids)
    for run, hf_dir in exports.items():
        hf.export_hf(run, hf_dir, recipe=recipe, max_shard_bytes=1 << 30, parse=arguments.parse)
    return out


def forward_and_export(recipe: str, load: str, ids: list, hf_dir: str):
    """One rank: our forward's logits of the checkpoint `load`, and its export to `hf_dir`."""
    from megatron_ext import hf

    ours = hf.logits(load, ids, recipe=recipe, extra=[], parse=arguments.parse)
    hf.export_hf(load, hf_dir, recipe=recipe, max_shard_bytes=1 << 30, parse=arguments.parse)
    return ours.numpy()


def refusals(hf_dirs: dict, root: str) -> dict:
    """One rank: the refusals of tests/hf/test_te_names.py test_dry_run_refuses_a_key_it_cannot_place
    (qwen3's import under a recipe without query/key norms; llama's with them), each line as raised."""
    from megatron_ext.errors import ConfigError

    ckpts = imports(hf_dirs, root)
    out = dict(ckpts)
    te = ("--platform", "cuda", "--assume-te")
    without_qk_norm = os.path.join(root, "no_qk_norm.yaml")
    with open(os.path.join(ckpts["qwen3"], "recipe.yaml")) as f, open(without_qk_norm, "w") as g:
        g.writelines(line for line in f if not line.startswith("qk_layernorm:"))
    llama_recipe = os.path.join(ckpts["llama"], "recipe.yaml")
    attempts = {
        "unplaced": lambda: parse(without_qk_norm, "--load", ckpts["qwen3"], *te),
        "log_all": lambda: parse(without_qk_norm, "--load", ckpts["qwen3"], *te, "--dist-ckpt-strictness", "log_all"),
        "missing": lambda: parse(llama_recipe, "--load", ckpts["llama"], "--qk-layernorm", *te),
    }
    for name, attempt in attempts.items():
        try:
            out[name] = attempt().checkpoint_keys
        except ConfigError as e:
            out[name] = str(e)
    args = parse(llama_recipe, "--qk-layernorm", "--transformer-impl", "local")  # no dry-run key check
    args.load = ckpts["llama"]
    try:
        through(args, os.path.join(root, "unused"))
    except ConfigError as e:
        out["missing_at_load"] = str(e)
    return out


def planner_traces(runs: list) -> list:
    """One rank: the planner's trace of each run's model ([recipe, *flags]) at its base shape (scripts/plan.py's first
    step: a tiny copy of the model on this process at the recipe's tensor parallelism, forward and
    backward, planned for the GPU cluster: transformer-engine); what each traced."""
    from megatron_ext.planner import cli, run, tiny, trace

    out = []
    for recipe, *flags in runs:
        _, args, _ = cli.parse(["--recipe", recipe, "--gpu", "h100", "--num-workers", "0", "--mock-data", *flags],
                               "--", arguments.parse)
        experts = tiny.traced_experts(args)
        base = tiny.base_shape(args, experts)
        kinds = [k for k in dict.fromkeys(run.layer_kinds(args)) for _ in range(2)]
        shape = (tiny.width_divisor(args), base["vocab"], base["seq"], base["mbs"], experts)
        traced = trace.run_shapes(args, {None: shape}, kinds, None)[None]
        out.append(dict(kinds=kinds, tp=args.tensor_model_parallel_size, ep=args.expert_model_parallel_size,
                        rope_fusion=args.apply_rope_fusion, saved_by=sorted({e[0] for e in traced["saved"].values()})))
    return out
