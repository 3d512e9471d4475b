"""Run in a fresh interpreter by tests/test_imports.py: import every module of the project and report,
as JSON on stdout, everything the imports changed in torch and in megatron-core.

    python -m tests.import_probe [--then-setup]

Watched: torch's function- and dispatch-mode stacks; the attributes of torch, torch.cuda,
torch.distributed, torch.Tensor, torch.nn.Module and torch.autograd; os.environ; and every attribute
of every megatron module (and of the classes it defines) as it stood right after that module ran.
A replaced or deleted attribute is a change; so is a new one, unless it is a submodule or a dunder.
--then-setup also runs platform.setup() at the end and reports again: the negative control, which
must see the CPU shims (or nothing, with CUDA).
"""
from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import sys
import types

import torch
import torch._dynamo  # noqa: F401 - torch's own import-time changes (it wraps torch.manual_seed, sets
import torch.distributed  # TORCHINDUCTOR_CACHE_DIR) happen before the snapshot, not during ours
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from megatron_ext import platform

# megatron-core cannot be imported at all here without this (triton, Python 3.11); it changes no
# attribute of torch or of a loaded megatron module.
platform.make_megatron_importable()

TORCH = {
    "torch": torch, "torch.cuda": torch.cuda, "torch.distributed": torch.distributed,
    "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module, "torch.autograd": torch.autograd,
}


def _vars(obj) -> dict:
    """A module's attributes without its metadata dunders; every attribute of a class."""
    if isinstance(obj, type):
        return dict(vars(obj))
    return {k: v for k, v in vars(obj).items() if not (k.startswith("__") and k.endswith("__"))}


def _snapshot_module(module) -> dict:
    snap = {module.__name__: _vars(module)}
    for value in list(vars(module).values()):
        if isinstance(value, type) and getattr(value, "__module__", None) == module.__name__:
            snap[f"{module.__name__}.{value.__qualname__}"] = (value, _vars(value))
    return snap


# megatron's own lazy caches, filled by megatron code that runs at import (utils.py:71 / :320)
MEGATRON_OWN = {"megatron.core.utils._te_version"}
MEGATRON: dict = {}  # "module" -> attrs, "module.Class" -> (class, attrs), right after the module ran


class _Watch(importlib.abc.MetaPathFinder):
    """Snapshots each megatron module the moment its own code has run."""

    def find_spec(self, name, path, target=None):
        if name != "megatron" and not name.startswith("megatron."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_snapshot(module):
            exec_module(module)
            for key, value in _snapshot_module(module).items():
                MEGATRON[key] = value if key != module.__name__ else (module, value)

        loader.exec_module = exec_and_snapshot
        return spec


def _diff(label: str, before: dict, after: dict) -> list[str]:
    out = []
    for k, v in before.items():
        if k not in after:
            out.append(f"{label}.{k} deleted")
        elif after[k] is not v:
            out.append(f"{label}.{k} replaced")
    for k in after.keys() - before.keys():
        # a submodule bound on import, or a dunder typing.Protocol fills in on first use (__init__)
        if not isinstance(after[k], types.ModuleType) and not (k.startswith("__") and k.endswith("__")):
            out.append(f"{label}.{k} added")
    return out


def changes(torch_before: dict, env_before: dict) -> dict:
    found = {
        "function_modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
        "dispatch_modes": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
        "torch": [c for name, obj in TORCH.items() for c in _diff(name, torch_before[name], _vars(obj))],
        "dynamo_disabled": torch._dynamo.config.disable,
        "environ": sorted(k for k in env_before.keys() | os.environ.keys() if env_before.get(k) != os.environ.get(k)),
        "megatron": [],
    }
    for key, (obj, attrs) in MEGATRON.items():
        found["megatron"] += [c for c in _diff(key, attrs, _vars(obj)) if c.rsplit(" ", 1)[0] not in MEGATRON_OWN]
    return found


def project_modules() -> tuple[list[str], list[str]]:
    """(runtime modules incl. the top-level train and arguments, the benchmarks' helper modules of scripts/bench/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(platform.__file__)))  # megatron_ext/
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        package = os.path.relpath(dirpath, os.path.dirname(root)).replace(os.sep, ".")
        names += [package if f == "__init__.py" else f"{package}.{f[:-3]}" for f in sorted(filenames) if f.endswith(".py")]
    bench_dir = os.path.join(os.path.dirname(root), "scripts", "bench")
    bench = ["bench"] + [f"bench.{f[:-3]}" for f in sorted(os.listdir(bench_dir))
                         if f.endswith(".py") and f != "__init__.py"]
    return ["train", "arguments"] + names, bench


def main() -> None:
    torch_before = {name: _vars(obj) for name, obj in TORCH.items()}
    env_before = dict(os.environ)
    sys.meta_path.insert(0, _Watch())
    runtime, bench = project_modules()
    for name in runtime:
        importlib.import_module(name)
    result = {"runtime": runtime, "bench": bench, "bench_imported_by_runtime": "bench" in sys.modules}
    for name in bench:
        importlib.import_module(name)
    result["megatron_modules_watched"] = sum(isinstance(obj, types.ModuleType) for obj, _ in MEGATRON.values())
    result["after_imports"] = changes(torch_before, env_before)
    if "--then-setup" in sys.argv:
        platform.setup()
        result["after_setup"] = changes(torch_before, env_before)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
