"""The conversion's modules keep to their own: no module of megatron_ext/hf (nor scripts/convert.py) uses
another module's private names; what import, export and the adapters share is public in the module
below them (hf/checkpoint.py, hfdir.py, table.py, outputs.py, world.py)."""
from __future__ import annotations

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def private_uses(source: str) -> list[str]:
    """`from megatron_ext... import _name` and `module._name` where `module` was imported from megatron_ext."""
    tree = ast.parse(source)
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_ext"):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{node.lineno} {node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("megatron_ext"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"{node.lineno} {node.value.id}.{node.attr}")
    return sorted(found)


def test_no_private_names_across_modules():
    paths = sorted(glob.glob(os.path.join(ROOT, "megatron_ext", "hf", "*.py"))) + [
        os.path.join(ROOT, "scripts", "convert.py")]
    assert len(paths) > 5
    found = {os.path.relpath(p, ROOT): private_uses(open(p).read()) for p in paths}
    assert {p: uses for p, uses in found.items() if uses} == {}


def test_negative_control_finds_private_uses():
    source = ("from megatron_ext.hf import convert\nfrom megatron_ext.hf.convert import _fill\n"
              "convert._check_fresh('--peft', out, False, 'x')\nself._own = 1\nconvert.__doc__\n")
    assert private_uses(source) == ["2 megatron_ext.hf.convert._fill", "3 convert._check_fresh"]


def test_a_model_is_named_as_transformers_and_peft_name_it(tmp_path):
    """hfdir.name_or_path: a snapshot of the hub cache by its repository id (what
    AutoPeftModelForCausalLM resolves), any other directory by its absolute path; an import records it
    in its copy of the directory, a training run's directory records none."""
    from megatron_ext.hf import hfdir

    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    assert hfdir.name_or_path(str(snapshot)) == "Qwen/Qwen3-8B"
    assert hfdir.name_or_path(str(tmp_path / "hub")) == str(tmp_path / "hub")
    (tmp_path / "ckpt" / "tokenizer").mkdir(parents=True)
    assert hfdir.imported_from(str(tmp_path / "ckpt")) is None
    (tmp_path / "ckpt" / "tokenizer" / "config.json").write_text('{"_name_or_path": "Qwen/Qwen3-8B"}')
    assert hfdir.imported_from(str(tmp_path / "ckpt")) == "Qwen/Qwen3-8B"
    assert hfdir.imported_from(str(tmp_path / "run")) is None
