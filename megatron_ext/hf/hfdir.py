"""A Hugging Face model directory, read: its config.json (a supported family, or a one-line refusal),
its safetensors shards and every tensor's file, shape and dtype from their headers, its tokenizer's
vocabulary. The import and the adapter import read through here; nothing here writes."""
from __future__ import annotations

import json
import os

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
# the files of a model directory that are its weights: the rest (tokenizer, configs) travels with a checkpoint
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", WEIGHTS_INDEX)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def read_json(flag: str, directory: str, name: str, what: str, required: tuple = ()) -> dict:
    """DIRECTORY/NAME parsed; a one-line refusal naming `flag` when the directory is missing, NAME is
    (then it is not `what`), a (file, why) of `required` is, or NAME is not JSON."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag}: no such directory")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise ConfigError(f"{flag}: no {name} (not {what})")
    for other, why in required:
        if not os.path.isfile(os.path.join(directory, other)):
            raise ConfigError(f"{flag}: no {other} ({why})")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ConfigError(f"{flag}: {name} is not JSON ({e})") from None


def read_config(hf_dir: str) -> tuple[str, families.Config]:
    """(the family's table name, the config) of HF_DIR/config.json; an unsupported architecture refused."""
    raw = read_json(f"--hf={hf_dir}", hf_dir, "config.json", "a Hugging Face model directory")
    model_type = raw.get("model_type")
    if model_type not in families.SUPPORTED:
        arch = (raw.get("architectures") or [model_type])[0]
        hint = families.INSTEAD.get(model_type)
        raise ConfigError(f"--hf={hf_dir}: architecture {arch} (model_type {model_type}) is not supported "
                          + (f"({hint})" if hint else f"(supported: {', '.join(families.SUPPORTED)})"))
    return families.ALIASES.get(model_type, model_type), families.Config(raw)


NAME_OR_PATH = "_name_or_path"  # transformers' config field: where a model was loaded from


def name_or_path(hf_dir: str) -> str:
    """How transformers and peft name the model of HF_DIR (``config.name_or_path``, peft's
    ``base_model_name_or_path``): a hub repository's id for a snapshot of the hub cache
    (``.../models--ORG--NAME/snapshots/REVISION``), else the directory's absolute path."""
    parts = os.path.abspath(hf_dir).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return os.path.abspath(hf_dir)


def imported_from(ckpt: str) -> str | None:
    """The model an import under CKPT was read from (its copy of the HF directory, CKPT/tokenizer,
    records it as ``_name_or_path``); None where CKPT is no import (a training run's directory)."""
    path = os.path.join(ckpt, "tokenizer", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get(NAME_OR_PATH) or None


def shard_files(hf_dir: str) -> list[str]:
    """The safetensors files of the weights (the index's, or the one file), each present."""
    index = os.path.join(hf_dir, WEIGHTS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise ConfigError(f"--hf={hf_dir}: no {WEIGHTS} or {WEIGHTS_INDEX} (only safetensors weights are read)")
    missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
    if missing:
        raise ConfigError(f"--hf={hf_dir}: missing shard {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return files


def tensors(hf_dir: str) -> dict[str, tuple[str, tuple, str]]:
    """Every HF tensor: (its file, shape, safetensors dtype), from the shards' headers."""
    from safetensors import safe_open

    found = {}
    for name in shard_files(hf_dir):
        path = os.path.join(hf_dir, name)
        with safe_open(path, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                found[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
    return found


def config_dtype(c: families.Config) -> torch.dtype:
    name = c.get("dtype") or c.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise families.refuse("dtype", name, f"supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def tokenizer_vocab(tok_dir: str) -> int:
    """The vocabulary size megatron's HuggingFaceTokenizer reports for these files (len(tokenizer))."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tok_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ConfigError(f"--hf: the tokenizer files do not load with AutoTokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None
