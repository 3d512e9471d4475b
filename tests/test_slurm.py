"""scripts/slurm/train.sbatch: syntax, and a dry expansion under fake slurm variables (a stub
`scontrol`, `srun` and `nvidia-smi` on PATH): rendezvous built from $SLURM_NNODES and the head node,
usage banner, required-variable checks, the command echoed, the exit code propagated, and the
environment srun passes to the job (CUDA_DEVICE_MAX_CONNECTIONS)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys

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
    # srun records its arguments and the environment it hands the job, and exits with $FAKE_SRUN_RC
    _stub(bin_dir, "srun", f'echo "$@" > {tmp_path}/srun.args; '
          f'echo "${{CUDA_DEVICE_MAX_CONNECTIONS-unset}}" > {tmp_path}/srun.connections; exit "${{FAKE_SRUN_RC:-0}}"')
    # the GPUs' compute capability, as nvidia-smi reports it on the batch node
    _stub(bin_dir, "nvidia-smi", 'for i in 1 2; do echo "${FAKE_COMPUTE_CAP:-9.0}"; done')
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "4",
        "SLURM_JOB_NODELIST": "gpu-node[03-06]",
        "SLURM_SUBMIT_DIR": ROOT,
        "RECIPE": RECIPE,
        "PYTHON": sys.executable,
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
    assert "--rdzv-endpoint gpu-node03:29411 --max-restarts 3 train.py" in out.stdout  # resumable: restarted


def test_max_restarts_without_a_checkpoint_dir(fake_slurm):
    env, _ = fake_slurm
    out = run({**env, "DRY_RUN": "1", "MAX_RESTARTS": "5"})
    assert "--rdzv-endpoint gpu-node03:29500 --max-restarts 5 train.py" in out.stdout


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


def _connections(env, tmp, *args):
    out = run(env, *args)
    assert out.returncode == 0, out.stderr
    return (tmp / "srun.connections").read_text().strip(), out.stdout


def test_tensor_parallel_exports_one_connection(fake_slurm):
    env, tmp = fake_slurm
    got, stdout = _connections(env, tmp, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert got == "1"  # megatron asserts it for TP on Hopper and earlier
    assert "env: export CUDA_DEVICE_MAX_CONNECTIONS=1" in stdout
    assert _connections(env, tmp, "--context-parallel-size=2")[0] == "1"
    assert _connections({**env, "FAKE_COMPUTE_CAP": "8.0"}, tmp, "--tensor-model-parallel-size", "4")[0] == "1"


def test_recipe_parallel_sizes_count_and_flags_override_them(fake_slurm, tmp_path):
    env, tmp = fake_slurm
    recipe = tmp_path / "tp8.yaml"
    recipe.write_text(open(os.path.join(ROOT, RECIPE)).read() + "tensor-model-parallel-size: 8\n")
    assert _connections({**env, "RECIPE": str(recipe)}, tmp)[0] == "1"
    assert _connections({**env, "RECIPE": str(recipe)}, tmp, "--tensor-model-parallel-size", "1")[0] == "unset"
    llama = "recipes/cluster/llama3_70b.yaml"  # TP8 with sequence parallelism
    assert _connections({**env, "RECIPE": llama}, tmp)[0] == "1"


def test_no_tensor_parallelism_leaves_it_alone(fake_slurm):
    env, tmp = fake_slurm
    got, stdout = _connections(env, tmp)
    assert got == "unset" and "env:" not in stdout
    assert _connections({**env, "CUDA_DEVICE_MAX_CONNECTIONS": "8"}, tmp)[0] == "8"


def test_megatron_fsdp_unsets_it(fake_slurm):
    env, tmp = fake_slurm
    env = {**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # inherited from the submitting shell
    got, stdout = _connections(env, tmp, "--use-megatron-fsdp", "--tensor-model-parallel-size", "2")
    assert got == "unset" and "env: unset CUDA_DEVICE_MAX_CONNECTIONS" in stdout


def test_blackwell_needs_no_single_connection(fake_slurm):
    env, tmp = fake_slurm
    assert _connections({**env, "FAKE_COMPUTE_CAP": "10.0"}, tmp, "--tensor-model-parallel-size", "2")[0] == "unset"
    assert _connections({**env, "GPU_ARCH": "9", "FAKE_COMPUTE_CAP": "10.0"}, tmp,
                        "--tensor-model-parallel-size", "2")[0] == "1"
