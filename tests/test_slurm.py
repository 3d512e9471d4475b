"""scripts/slurm/train.sbatch: syntax, and a dry expansion under fake slurm variables (a stub
`scontrol` and `srun` on PATH): rendezvous built from $SLURM_NNODES and the head node, usage banner,
required-variable checks, the command echoed, the exit code propagated."""
from __future__ import annotations

import os
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm", "train.sbatch")
RECIPE = "recipes/tiny_dense.yaml"


def _stub(directory, name, body):
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write("#!/bin/bash\n" + body + "\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `scontrol show hostnames node[03-06]` expands the node list, one name per line
    _stub(bin_dir, "scontrol", 'for i in 03 04 05 06; do echo "gpu-node$i"; done')
    # srun records its arguments and exits with $FAKE_SRUN_RC
    _stub(bin_dir, "srun", f'echo "$@" > {tmp_path}/srun.args; exit "${{FAKE_SRUN_RC:-0}}"')
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "gpu-node[03-06]",
        "SLURM_SUBMIT_DIR": ROOT,
        "RECIPE": RECIPE,
    }
    return env, tmp_path


def run(env, *args):
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=30)


def test_syntax():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_expansion(fake_slurm):
    env, _ = fake_slurm
    out = run({**env, "DRY_RUN": "1", "GPUS_PER_NODE": "8"}, "--lr", "1e-4")
    assert out.returncode == 0, out.stderr
    cmd = next(line for line in out.stdout.splitlines() if line.startswith("+ "))
    assert cmd == (
        "+ srun --ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 4 --nproc-per-node 8 "
        "--rdzv-id 4242 --rdzv-backend c10d --rdzv-endpoint gpu-node03:29500 "
        f"train.py --recipe {RECIPE} --lr 1e-4"
    )


def test_checkpoint_dir_and_port(fake_slurm):
    env, _ = fake_slurm
    out = run({**env, "DRY_RUN": "1", "CKPT_DIR": "/ckpt/run1", "RDZV_PORT": "29411"})
    assert "--rdzv-endpoint gpu-node03:29411" in out.stdout
    assert f"--recipe {RECIPE} --save /ckpt/run1 --load /ckpt/run1" in out.stdout


def test_required_variables_named(fake_slurm):
    env, _ = fake_slurm
    env = {k: v for k, v in env.items() if k not in ("RECIPE", "SLURM_NNODES")}
    out = run(env)
    assert out.returncode == 2
    assert "RECIPE SLURM_NNODES" in out.stderr and "Usage:" in out.stderr


def test_missing_recipe_file(fake_slurm):
    env, _ = fake_slurm
    out = run({**env, "RECIPE": "recipes/nope.yaml"})
    assert out.returncode == 2 and "recipes/nope.yaml" in out.stderr


def test_usage_banner():
    out = subprocess.run(["bash", SCRIPT, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "Usage:" in out.stdout and "RECIPE" in out.stdout


@pytest.mark.parametrize("rc", [0, 3])
def test_exit_code_propagated(fake_slurm, rc):
    env, tmp = fake_slurm
    out = run({**env, "FAKE_SRUN_RC": str(rc)})
    assert out.returncode == rc, out.stderr
    assert f"exited with code {rc}" in out.stdout
    assert (tmp / "srun.args").read_text().startswith("--ntasks-per-node=1 --kill-on-bad-exit=1 torchrun --nnodes 4")
