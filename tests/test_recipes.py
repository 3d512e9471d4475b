"""Every recipe under recipes/ passes --dry-run at the world size it declares (``world_size:``,
else 1); every cluster recipe states its expected per-GPU memory, equal to megatron's theoretical
estimate (scripts/estimate_memory.py) and under the stated GPU's 80 GB."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re

import pytest
import yaml

import arguments
from scripts.estimate_memory import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True))
CLUSTER = [r for r in RECIPES if r.startswith(os.path.join("recipes", "cluster"))]
H100_GIB = 80e9 / 2**30


def test_cluster_recipes_exist():
    names = {os.path.basename(r) for r in CLUSTER}
    assert {"llama3_70b.yaml", "mixtral_8x7b.yaml", "deepseek_v3.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_at_declared_world_size(recipe, monkeypatch):
    monkeypatch.chdir(ROOT)
    declared = (yaml.safe_load(open(recipe)) or {}).get("world_size", 1)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        args = arguments.parse(["--recipe", recipe, "--dry-run"], exit_on_dry_run=False)
    assert args.world_size == declared
    assert "resolved configuration" in out.getvalue()
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    assert args.data_parallel_size * model_parallel == declared


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
