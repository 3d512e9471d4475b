"""Every recipe under recipes/ passes --dry-run at the world size it declares (``world_size:``,
else 1), cluster recipes validated for their cluster (``--platform cuda``) with transformer-engine
assumed present and absent (or refused by name where the recipe pins it); every cluster recipe
states its expected per-GPU memory, equal to megatron's theoretical estimate
(scripts/estimate_memory.py) and under the stated GPU's 80 GB."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re

import pytest
import yaml

import arguments
from megatron_ext.errors import ConfigError
from scripts.estimate_memory import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True))
CLUSTER = [r for r in RECIPES if r.startswith(os.path.join("recipes", "cluster"))]
H100_GIB = 80e9 / 2**30
CUDA = {"te": ["--platform", "cuda", "--assume-te"], "no-te": ["--platform", "cuda", "--assume-no-te"]}


def dry_run(recipe, *extra):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        args = arguments.parse(["--recipe", recipe, "--dry-run", *extra], exit_on_dry_run=False)
    return args, out.getvalue()


def test_cluster_recipes_exist():
    names = {os.path.basename(r) for r in CLUSTER}
    assert {"llama3_70b.yaml", "mixtral_8x7b.yaml", "deepseek_v3.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_at_declared_world_size(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    declared = (yaml.safe_load(open(recipe)) or {}).get("world_size", 1)
    args, out = dry_run(recipe, *(CUDA["te"] if recipe in CLUSTER else []))
    assert args.world_size == declared
    assert "resolved configuration" in out
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.data_parallel_size * model_parallel == declared


@pytest.mark.parametrize("te", sorted(CUDA))
@pytest.mark.parametrize("recipe", CLUSTER)
def test_cluster_recipe_starts_on_cuda(recipe, te, monkeypatch):
    """What megatron would fail on at model build on the cluster is settled at --dry-run: the layer
    spec the recipe needs, no fusion whose kernel the target lacks (apex is absent), the launch
    environment megatron asserts for TP on Hopper."""
    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load(open(recipe))
    pinned = raw.get("transformer_impl")
    if te == "no-te" and pinned == "transformer_engine":
        with pytest.raises(ConfigError, match=r"^--transformer-impl=transformer_engine \(recipe\): no "
                           r"transformer-engine on the target \(--assume-te if the cluster has it\)"):
            dry_run(recipe, *CUDA[te])
        return
    args, out = dry_run(recipe, *CUDA[te])
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.world_size == raw["world_size"] == args.data_parallel_size * model_parallel
    assert args.transformer_impl == (pinned or ("transformer_engine" if te == "te" else "local"))
    local = args.transformer_impl == "local"
    assert not args.gradient_accumulation_fusion  # apex's kernel: every ColumnParallelLinear checks it
    assert not (local and args.masked_softmax_fusion)  # apex's softmax kernel (local attention)
    assert not (local and not args.no_persist_layer_norm)  # torch's norm refuses persist
    assert te == "te" or not args.apply_rope_fusion  # transformer-engine's rope kernel
    assert args.bias_swiglu_fusion == raw.get("bias_swiglu_fusion", True)  # torch.compile runs on CUDA
    tp_or_cp = args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1
    assert args.launch_env == ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp_or_cp else {})
    assert "declared cuda (h100, compute capability 9.0), transformer-engine " + ("present" if te == "te" else "absent") in out


@pytest.mark.parametrize("recipe", CLUSTER)
def test_cluster_recipe_states_its_memory(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    text = open(recipe).read()
    stated = re.search(r"weights\+grads\+optimizer ([\d.]+) GiB \+ activations ([\d.]+) GiB\s*=\s*([\d.]+) GiB", text)
    assert stated, f"{recipe}: no 'Expected memory per GPU' line"
    assert "Cluster:" in text and "Layout:" in text
    got = estimate(recipe)
    assert float(stated.group(1)) == pytest.approx(got["weights+grads+optimizer GiB"], abs=0.06)
    assert float(stated.group(2)) == pytest.approx(got["activations GiB"], abs=0.06)
    assert float(stated.group(3)) == pytest.approx(got["total GiB"], abs=0.06)
    assert got["total GiB"] < 0.85 * H100_GIB, "leave headroom for what the estimate does not count"
