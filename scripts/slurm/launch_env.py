"""The launch environment megatron needs on the cluster, for train.sbatch, without importing torch.

    python3 scripts/slurm/launch_env.py RECIPE [train.py flags...]

Prints shell lines for the batch script to eval: ``export CUDA_DEVICE_MAX_CONNECTIONS=1`` with
tensor or context parallelism on GPUs before Blackwell (megatron asserts it), ``unset
CUDA_DEVICE_MAX_CONNECTIONS`` with Megatron-FSDP or torch FSDP2 (they want several hardware
queues), nothing otherwise. The rule is megatron_ext/platform/target.py's ``launch_env`` (loaded by
path: that file imports nothing heavy). Parallel sizes follow train.py's precedence, defaults <
recipe < flags; the GPU generation is read with nvidia-smi (``GPU_ARCH`` overrides it; Hopper is
assumed when neither answers).
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {  # dest -> default
    "tensor_model_parallel_size": 1,
    "context_parallel_size": 1,
    "use_megatron_fsdp": False,
    "use_torch_fsdp2": False,
}


def _target_module():
    # target.py imports megatron_ext.errors (no torch), from the environment the job trains in
    spec = importlib.util.spec_from_file_location(
        "megatron_ext_launch_target", os.path.join(ROOT, "megatron_ext", "platform", "target.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks the module up while the file runs
    spec.loader.exec_module(module)
    return module


def resolve(recipe: str, argv: list[str]) -> dict:
    values = dict(KEYS)
    with open(recipe) as f:
        raw = yaml.safe_load(f) or {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in values:
            values[name] = value
    i = 0
    while i < len(argv):
        flag, _, inline = argv[i].partition("=")
        name = flag.lstrip("-").replace("-", "_")
        if flag.startswith("--") and name in values:
            if isinstance(KEYS[name], bool):
                values[name] = True
            else:
                value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else "")
                i += 0 if inline else 1
                values[name] = int(value)
        i += 1
    return values


def gpu_arch(default: int) -> int:
    if os.environ.get("GPU_ARCH"):
        return int(os.environ["GPU_ARCH"])
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0].split(".")[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return default


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    target = _target_module()
    v = resolve(argv[0], argv[1:])
    env = target.launch_env(
        tp=int(v["tensor_model_parallel_size"]), cp=int(v["context_parallel_size"]),
        fsdp=bool(v["use_megatron_fsdp"] or v["use_torch_fsdp2"]), arch=gpu_arch(target.ASSUMED_CUDA_ARCH),
    )
    for name, value in env.items():
        print(f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
