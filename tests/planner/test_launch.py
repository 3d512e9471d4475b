"""The planner hands over a launch: the winner's torchrun line per node and the slurm template's
invocation (run here by the template itself, dry, under fake slurm variables), one row per
configuration, and when nothing fits the nearest ways to fit with their predicted peaks. One job
plans one tiny model (shared traces) on 16 GPUs of 8 per node and with the split search on 2."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tests.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = "recipes/tiny_dense.yaml"
USER_FLAGS = ["--num-attention-heads", "1", "--global-batch-size", "64", "--world-size", "16",
              "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def plans():
    return run_distributed(1, "tests.planner.launch_jobs:plans")[0]


def _sbatch_dry(launch: dict, tmp_path) -> list:
    """Run scripts/slurm/train.sbatch as the planner's sbatch line asks (its variables and flags),
    dry, under fake slurm variables and a Hopper nvidia-smi: the lines it prints."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("scontrol", 'for i in $(seq 1 "$SLURM_NNODES"); do printf "gpu-node%02d\\n" "$i"; done'),
                       ("nvidia-smi", 'echo "9.0"')):
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body + "\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    sbatch = launch["sbatch"]
    nodes = int(next(a for a in sbatch if a.startswith("--nodes=")).split("=")[1])
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "SLURM_JOB_ID": "4242",
           "SLURM_NNODES": str(nodes), "SLURM_JOB_NODELIST": f"gpu-node[1-{nodes}]", "SLURM_SUBMIT_DIR": ROOT,
           "PYTHON": sys.executable, "DRY_RUN": "1", **launch["sbatch_env"]}
    script = sbatch.index("scripts/slurm/train.sbatch")
    done = subprocess.run(["bash", os.path.join(ROOT, sbatch[script]), *sbatch[script + 1:]], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _torchrun_as_the_template_runs_it(launch: dict) -> str:
    words = [w.replace("$HEAD_NODE", "gpu-node01") for w in launch["torchrun"]]
    return " ".join("4242" if w == "megatron_ext" else w for w in words)


def test_winner_comes_with_its_launch_on_two_nodes(plans, tmp_path):
    from megatron_ext.planner import settings

    p = plans["launch"]
    lch, given = p["launch"], p["given"]
    assert p["winner_fits"] and not p["winner_as_given"] and p["winner_flags"]
    # the winner's flags are exactly the settings it changes, each to a value the run did not have
    changed = settings.changed(given, p["winner_settings"])
    assert changed and p["winner_flags"] == settings.render(p["winner_settings"], changed)
    assert all(f.startswith("--recompute") or f.startswith("--activation-offload") for f in changed), changed
    # 16 GPUs of 8 per node: two nodes, torchrun on each with the template's c10d rendezvous
    assert (lch["world_size"], lch["nodes"], lch["gpus_per_node"]) == (16, 2, 8)
    assert lch["torchrun"][:11] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-id", "megatron_ext",
                                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "$HEAD_NODE:29500"]
    # train.py: the recipe, the run's own flags (not the planner's), then the winner's
    assert lch["train"] == ["train.py", "--recipe", RECIPE, *USER_FLAGS, *p["winner_flags"]]
    assert lch["torchrun"][11:] == lch["train"]
    # parsed back as train.py parses it (for the cluster), it is the winner's configuration
    assert lch["checked"] and not lch["recipe_changes"] and not lch["unexplained"]
    assert p["parsed"] == p["winner_settings"]
    # the slurm template's variables and the sbatch line; --json has the same, as shell commands too
    assert lch["sbatch_env"] == {"RECIPE": RECIPE, "GPUS_PER_NODE": "8"}
    assert lch["sbatch"] == ["sbatch", "--nodes=2", "--gpus-per-node=8", "scripts/slurm/train.sbatch",
                             *USER_FLAGS, *p["winner_flags"]]
    assert p["json"]["sbatch_command"] == ("RECIPE=recipes/tiny_dense.yaml GPUS_PER_NODE=8 sbatch --nodes=2 "
                                           "--gpus-per-node=8 scripts/slurm/train.sbatch " + " ".join(lch["train"][3:]))
    assert p["json"]["torchrun_command"].startswith("torchrun --nnodes 2 --nproc-per-node 8 ")
    # TP1: megatron needs no CUDA_DEVICE_MAX_CONNECTIONS, and the template sets none either
    assert lch["env"] == {}
    lines = _sbatch_dry(lch, tmp_path)
    assert "+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + _torchrun_as_the_template_runs_it(lch) in lines
    assert not any(line.startswith("env:") for line in lines)


def test_launch_environment_follows_tensor_parallelism_and_the_gpu(plans, tmp_path):
    """The same launch on TP2: CUDA_DEVICE_MAX_CONNECTIONS=1 on Hopper, as the slurm template decides
    too (scripts/slurm/launch_env.py); nothing on Blackwell. Nodes for worlds that do not fill them."""
    p = plans["launch"]
    h100, b200 = p["tp2_h100"], p["tp2_b200"]
    assert h100["env"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and b200["env"] == {}
    assert h100["train"] == ["train.py", "--recipe", RECIPE, *USER_FLAGS[2:], "--tensor-model-parallel-size", "2",
                             "--sequence-parallel", *p["winner_flags"]]
    assert h100["checked"] and not h100["unexplained"]
    lines = _sbatch_dry(h100, tmp_path)
    assert "env: export CUDA_DEVICE_MAX_CONNECTIONS=1" in lines
    assert "+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 " + _torchrun_as_the_template_runs_it(h100) in lines
    assert p["odd_world"] == (2, 6) and p["small_world"] == (1, 4)  # 12 GPUs: two nodes of 6


def test_launch_switches_off_what_the_run_sets(plans):
    """Recompute off for a run that asks for it: on the command line the flag is dropped from the
    launch (parsed back: no recompute); in the recipe the command line cannot unset it, and the
    launch names the recipe key to remove."""
    cli, recipe = plans["switch_off"]["cli"], plans["switch_off"]["recipe"]
    assert cli["given"]["--recompute-granularity"] == recipe["given"]["--recompute-granularity"] == "selective"
    assert "--recompute-granularity" not in cli["launch"]["train"] and "selective" not in cli["launch"]["train"]
    assert cli["launch"]["checked"] and cli["launch"]["recipe_changes"] == []
    assert not recipe["launch"]["checked"] and recipe["launch"]["recipe_changes"] == ["recompute_granularity"]
    assert recipe["launch"]["unexplained"] == []


def test_no_configuration_is_two_rows(plans):
    """The split search on 2 GPUs evaluates the run's own split (TP1 PP1 DP2 mbs2) with every
    recompute / offload option: the run as given is one row, and no two rows whose predictions
    agree are one configuration (their command lines, parsed, differ)."""
    d = plans["duplicates"]
    assert d["as_given_rows"] == 1
    assert sum(1 for as_given, _layout, flags in d["rows"] if not as_given and not flags) == 0
    assert len({(layout, tuple(flags)) for _as_given, layout, flags in d["rows"]}) == len(d["rows"])
    keys = [k for _layout, _flags, k in d["twins"]]
    assert len(set(keys)) == len(keys), d["twins"]
    assert len(d["rows"]) > 10  # layouts PP1 / PP2 / PP2 x VPP2, micro-batch 1 / 2, each with the options


def test_nothing_fits_names_the_nearest_ways_with_their_peaks(plans):
    """A budget below every candidate on 16 GPUs: no winner; the nearest ways to fit, ranked by how
    far over the budget each is (its real prediction), and the smallest world size that fits, whose
    command, planned as given, fits with the peak the hint said."""
    n = plans["nothing_fits"]
    budget, nearest = n["budget"], n["nearest"]
    assert "\n" not in n["refusal"]
    assert n["refusal"].startswith("--memory-gb=") and "no configuration fits" in n["refusal"]
    more = [h for h in nearest if h["kind"] == "more GPUs"]
    here = [h for h in nearest if h["kind"] != "more GPUs"]
    assert len(more) == 1 and nearest[0] == more[0]
    # on these GPUs: each over the budget by its predicted peak, closest first, the same prediction
    # as the search made for that configuration with a budget that fits everything
    assert here and all(h["peak_bytes"] > budget and not h["fits"] for h in here)
    assert [h["over_budget_bytes"] for h in here] == sorted(h["over_budget_bytes"] for h in here)
    assert all(h["over_budget_bytes"] == round(h["peak_bytes"] - budget) for h in here)
    for h, key in zip(nearest, n["nearest_keys"]):
        if h["kind"] != "more GPUs":
            assert h["peak_bytes"] == round(n["peaks"][key]), h
    kinds = {h["kind"] for h in here}
    assert {"recompute / offload", "as given"} <= kinds, kinds
    # more GPUs: twice the GPUs (4 nodes) is the smallest that fits; its own launch
    m = more[0]
    assert m["fits"] and m["world_size"] == 32 and m["peak_bytes"] <= budget and m["over_budget_bytes"] <= 0
    assert "--world-size" in m["flags"] and m["flags"][m["flags"].index("--world-size") + 1] == "32"
    assert (m["launch"]["nodes"], m["launch"]["gpus_per_node"]) == (4, 8) and m["launch"]["checked"]
    assert "fits on 32 GPUs (4 x 8)" in n["refusal"]
    r = n["replanned"]
    assert r["fits"] and round(r["peak"]) == m["peak_bytes"], (r, m)
