"""Hugging Face <-> megatron checkpoints, through the model megatron-core builds from the recipe.

import: HF directory -> CKPT/recipe.yaml (every architecture flag the config implies), CKPT/tokenizer/
        (the HF directory without its weights: tokenizer files, config.json, generation_config.json),
        CKPT/iter_0000000 (the project's torch_dist checkpoint, model weights only; dist_checkpointing
        reshards it into any layout). The model is built once in this process (one rank) and the HF
        shards stream into it one file at a time, one tensor at a time: peak host memory is the model
        plus the largest tensor group of one row (a layer's q/k/v, an expert's gate/up, a layer's stacked
        experts).
export: CKPT (any layout it was trained on, resharded to one rank on load) -> config.json, safetensors
        shards (and their index above one shard), tokenizer files; written one shard at a time.
(A LoRA run loads with the flags its checkpoint records and exports merged: hf/peft.py; the logits of
packed sequences: hf/packed.py.)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
RECIPE = "recipe.yaml"
TOKENIZER = "tokenizer"
SIDE_FILES_SKIPPED = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", WEIGHTS_INDEX)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_FLAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


# ---------------------------------------------------------------------------------------------
# the HF directory
# ---------------------------------------------------------------------------------------------
def read_hf_config(hf_dir: str) -> tuple[str, families.Config]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"--hf={hf_dir}: no such directory")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf={hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except ValueError as e:
        raise ConfigError(f"--hf={hf_dir}: config.json is not JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type not in families.SUPPORTED:
        arch = (raw.get("architectures") or [model_type])[0]
        hint = families.INSTEAD.get(model_type)
        raise ConfigError(f"--hf={hf_dir}: architecture {arch} (model_type {model_type}) is not supported "
                          + (f"({hint})" if hint else f"(supported: {', '.join(families.SUPPORTED)})"))
    return families.ALIASES.get(model_type, model_type), families.Config(raw)


def shard_files(hf_dir: str) -> list[str]:
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


def config_dtype(c: families.Config) -> torch.dtype:
    name = c.get("dtype") or c.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise families.refuse("dtype", name, f"supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def vocab_divisor(vocab: int, tokenizer_vocab: int) -> tuple[int, int]:
    """(make_vocab_size_divisible_by, the largest TP it holds for) such that megatron pads the
    tokenizer's vocabulary to exactly the HF embedding's rows under every TP dividing that size:
    D = V / K gives ceil(T / (D tp)) D tp = V for tp | K whenever V - D < T <= V."""
    for k in (64, 32, 16, 8, 4, 2, 1):
        if vocab % k == 0 and vocab - vocab // k < tokenizer_vocab <= vocab:
            return vocab // k, k
    raise ConfigError(f"config.json: vocab_size={vocab}: below the tokenizer's {tokenizer_vocab} ids")


def recipe_for(model_type: str, c: families.Config, ckpt: str, tokenizer_vocab: int) -> dict:
    out = families.flags(model_type, c)
    dtype = config_dtype(c)
    if dtype in DTYPE_FLAG:
        out[DTYPE_FLAG[dtype]] = True
    vocab = c["vocab_size"]
    divisor, max_tp = vocab_divisor(vocab, tokenizer_vocab)
    out.update(make_vocab_size_divisible_by=divisor, tokenizer_type="HuggingFaceTokenizer",
               tokenizer_model=os.path.abspath(os.path.join(ckpt, TOKENIZER)),
               seq_length=min(out["max_position_embeddings"], 4096))
    unread = c.unread()
    if unread:
        raise families.refuse(unread[0], c.raw[unread[0]], "this field is not representable in megatron_ext "
                              f"(model_type {model_type})")
    out["_max_tp"] = max_tp
    return out


def write_recipe(path: str, flags: dict, model_type: str) -> None:
    import yaml

    max_tp = flags.pop("_max_tp")
    with open(path, "w") as f:
        f.write(f"# Imported from a Hugging Face {model_type} model by scripts/convert.py: its architecture and tokenizer.\n"
                f"# Add data, batch sizes, schedule and layout flags. The embedding keeps vocab_size rows\n"
                f"# under any tensor-parallel size dividing {max_tp}.\n")
        yaml.safe_dump(flags, f, sort_keys=False)


def _progress(total: int, desc: str):
    """A progress bar over one shard file's tensors, on a terminal (or with MEGATRON_EXT_PROGRESS=1)."""
    if not (sys.stderr.isatty() or os.environ.get("MEGATRON_EXT_PROGRESS")):
        return contextlib.nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------------------------------
# the megatron model of a recipe, on one rank (import, export) or under torchrun (logits)
# ---------------------------------------------------------------------------------------------
def open_run(recipe: str, extra: list[str]):
    """The run of the recipe's model (megatron_ext/training/run.py), one micro-batch of mock data:
    what import, export and logits build and load through."""
    from megatron_ext.training.run import Run

    argv = ["--recipe", recipe, "--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--num-workers", "0", *extra]
    if "--global-batch-size" not in extra:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        argv += ["--global-batch-size", "1"] if world == 1 else []
    return Run.from_argv(argv)


def unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_tensors(chunk) -> dict[str, torch.Tensor]:
    """Parameter and persistent-buffer tensors of one model chunk by state-dict name."""
    return {k: v for k, v in unwrap(chunk).state_dict(keep_vars=True).items()
            if "_extra_state" not in k and isinstance(v, torch.Tensor)}


# ---------------------------------------------------------------------------------------------
# the table, expanded for one model
# ---------------------------------------------------------------------------------------------
def expand(model_type: str, c: families.Config, names) -> list[tuple[tuple[str, ...], list[str], str]]:
    """The family's table with {L} and {E} filled in, kept where the model has the megatron names:
    rows of (megatron names, HF names, transform); a stacked row has one megatron name per expert."""
    layers = c["num_hidden_layers"]
    experts = c.raw.get("num_experts") or c.raw.get("num_local_experts") or c.raw.get("n_routed_experts") or 0
    rows = []
    for mg, hf, kind in families.TABLES[model_type]:
        stacked = kind.startswith("stacked")
        for layer in range(layers) if "{L}" in mg else [None]:
            for expert in range(experts) if "{E}" in mg and not stacked else [None]:
                def fill(s, e=expert):
                    return s.replace("{L}", str(layer)).replace("{E}", str(e))
                mgs = tuple(fill(mg, e) for e in range(experts)) if stacked else (fill(mg),)
                if all(m in names for m in mgs):
                    rows.append((mgs, [fill(h) for h in hf], kind))
    covered = {m for r in rows for m in r[0]}
    uncovered = sorted(n for n in names if n not in covered)
    if uncovered:
        raise ConfigError(f"the {model_type} table maps no HF tensor to {uncovered[0]} (the recipe builds a model "
                          "this family's table does not describe)")
    return rows


def _interleaved(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate (even) and up (odd) of an interleaved last dimension."""
    return t[..., ::2], t[..., 1::2]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], -1).flatten(-2)


def to_megatron(kind: str, parts: list[torch.Tensor], c: families.Config) -> list[torch.Tensor]:
    """One row's HF tensors -> its megatron tensors (one per megatron name)."""
    if kind == "copy":
        return [parts[0]]
    if kind == "glu":
        return [torch.cat(parts, 0)]
    if kind == "qkv":
        q, k, v = parts
        groups = k.shape[0] // _head_dim(c)
        return [torch.cat([q.reshape(groups, -1, *q.shape[1:]), k.reshape(groups, -1, *k.shape[1:]),
                           v.reshape(groups, -1, *v.shape[1:])], 1).reshape(-1, *q.shape[1:])]
    (t,) = parts
    if kind == "stacked_glu_t":  # [E, h, 2f] -> [2f, h] each
        return [torch.cat(_interleaved(e), -1).t() for e in t]
    if kind == "stacked_glu":  # [E, 2f] -> [2f] each
        return [torch.cat(_interleaved(e), -1) for e in t]
    if kind == "stacked_t":  # [E, f, h] -> [h, f] each
        return [e.t() for e in t]
    assert kind == "stacked", kind
    return list(t)


def to_hf(kind: str, ts: list[torch.Tensor], c: families.Config) -> list[torch.Tensor]:
    """One row's megatron tensors -> its HF tensors (the inverse of to_megatron)."""
    if kind == "copy":
        return [ts[0]]
    if kind == "glu":
        return [p.clone() for p in ts[0].chunk(2, 0)]
    if kind == "qkv":
        t, d = ts[0], _head_dim(c)
        heads, groups = c.raw["num_attention_heads"], c.raw.get("num_key_value_heads") or c.raw["num_attention_heads"]
        g = t.reshape(groups, (heads // groups + 2) * d, *t.shape[1:])
        q, k, v = g.split([heads // groups * d, d, d], 1)
        return [x.reshape(-1, *t.shape[1:]).clone() for x in (q, k, v)]
    if kind == "stacked_glu_t":
        return [torch.stack([_interleave(*t.t().chunk(2, -1)) for t in ts])]
    if kind == "stacked_glu":
        return [torch.stack([_interleave(*t.chunk(2, -1)) for t in ts])]
    if kind == "stacked_t":
        return [torch.stack([t.t() for t in ts])]
    assert kind == "stacked", kind
    return [torch.stack(ts)]


def _head_dim(c: families.Config) -> int:
    return c.raw.get("head_dim") or c.raw["hidden_size"] // c.raw["num_attention_heads"]


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------
def import_hf(hf_dir: str, save: str) -> str:
    """HF directory -> megatron checkpoint under `save`; returns the recipe's path."""
    from safetensors import safe_open

    model_type, c = read_hf_config(hf_dir)
    files = shard_files(hf_dir)
    os.makedirs(save, exist_ok=True)
    tok_dir = os.path.join(save, TOKENIZER)
    if os.path.isdir(tok_dir):
        shutil.rmtree(tok_dir)
    shutil.copytree(hf_dir, tok_dir, ignore=lambda d, names: [n for n in names if n.endswith(SIDE_FILES_SKIPPED)])
    tokenizer_vocab = _tokenizer_vocab(tok_dir)
    flags = recipe_for(model_type, c, save, tokenizer_vocab)
    recipe = os.path.join(save, RECIPE)
    write_recipe(recipe, flags, model_type)

    run = open_run(recipe, ["--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng", "--world-size", "1"])
    with run:
        args, model = run.args, run.build(wrap=False)
        if args.padded_vocab_size != c["vocab_size"]:
            raise ConfigError(f"config.json: vocab_size={c['vocab_size']}: megatron pads the tokenizer's "
                              f"{tokenizer_vocab} ids to {args.padded_vocab_size}")
        tensors = model_tensors(model[0])
        rows = expand(model_type, c, tensors)
        wanted = {h: row for row in rows for h in row[1]}
        pending: dict[str, dict] = {}
        filled = set()
        for name in files:
            path = os.path.join(hf_dir, name)
            with safe_open(path, "pt") as f, _progress(len(f.keys()), name) as bar, torch.no_grad():
                for key in f.keys():
                    if key not in wanted:
                        raise ConfigError(f"{path}: tensor {key} is not part of a {model_type} model with this config")
                    mgs, hf_names, kind = wanted[key]
                    parts = pending.setdefault(mgs, {})
                    parts[key] = f.get_tensor(key)
                    if len(parts) == len(hf_names):
                        _check_stack(parts, hf_names, mgs, kind, path)
                        for mg, value in zip(mgs, to_megatron(kind, [parts[h] for h in hf_names], c)):
                            _fill(tensors[mg], value, mg, hf_names, path)
                        del pending[mgs]
                        filled.add(mgs)
                    if bar is not None:
                        bar.update(1)
        missing = [h for mgs, hf_names, _ in rows if mgs not in filled for h in hf_names
                   if h not in pending.get(mgs, {})]
        if missing:
            raise ConfigError(f"--hf={hf_dir}: tensor {missing[0]} is missing from the shards")
        run.save(0, weights_only=True)
    return recipe


def _check_stack(parts: dict, hf_names: list[str], mgs: tuple, kind: str, path: str) -> None:
    """A stacked HF tensor holds one entry per expert on its first dimension."""
    t = parts[hf_names[0]]
    if kind.startswith("stacked") and (t.dim() < 1 or t.shape[0] != len(mgs)):
        raise ConfigError(f"{path}: {hf_names[0]}: shape {tuple(t.shape)} does not match the config's "
                          f"{len(mgs)} experts")


def _fill(param: torch.Tensor, value: torch.Tensor, mg: str, hf_names: list[str], path: str) -> None:
    if value.shape != param.shape:
        raise ConfigError(f"{path}: {', '.join(hf_names)}: shape {tuple(value.shape)} does not match the config's "
                          f"{tuple(param.shape)} ({mg})")
    if value.dtype != param.dtype:
        raise ConfigError(f"{path}: {hf_names[0]}: dtype {str(value.dtype).replace('torch.', '')} does not match "
                          f"the config's {str(param.dtype).replace('torch.', '')}")
    param.data.copy_(value)


def _tokenizer_vocab(tok_dir: str) -> int:
    """The vocabulary size megatron's HuggingFaceTokenizer reports for these files (len(tokenizer))."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tok_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ConfigError(f"--hf: the tokenizer files do not load with AutoTokenizer ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''})") from None


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def load_model(load: str, recipe: str | None, extra: list[str]):
    """The run of `recipe` (default LOAD/recipe.yaml) with the newest checkpoint under `load`,
    weights only, as --finetune loads them; the caller enters it (`with load_model(...) as run`)."""
    from megatron_ext.hf import peft

    recipe = recipe or os.path.join(load, RECIPE)
    if not os.path.isfile(recipe):
        raise ConfigError(f"--load={load}: no {RECIPE} there (pass --recipe, the imported checkpoint's recipe)")
    return _Loaded(open_run(recipe, ["--load", load, "--finetune", "--no-load-optim", "--no-load-rng",
                                     "--exit-on-missing-checkpoint", *peft.recorded_lora_flags(load), *extra]))


class _Loaded:
    """A run whose weights are loaded as it is entered (the loader's lines kept off stdout)."""

    def __init__(self, run):
        self.run = run

    def __enter__(self):
        self.run.__enter__()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                self.run.load(weights_only=True)
        except BaseException:
            self.run.teardown()
            raise
        return self.run

    def __exit__(self, *exc):
        return self.run.__exit__(*exc)


def export_hf(load: str, out: str, recipe: str | None = None, max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Megatron checkpoint -> HF directory `out`; returns the shard file names."""
    from safetensors.torch import save_file

    from megatron_ext.hf import peft

    recipe = recipe or os.path.join(load, RECIPE)
    with load_model(load, recipe, ["--world-size", "1"]) as run:
        args, model = run.args, run.model
        peft.merge_adapters(model)  # a LoRA run's adapters into its base weights
        tok_dir = args.tokenizer_model
        model_type, c = read_hf_config(tok_dir)
        tensors = model_tensors(model[0])
        rows = expand(model_type, c, tensors)
        # shards: consecutive rows until the next would pass max_shard_bytes
        shards, size = [[]], 0
        for row in rows:
            nbytes = sum(tensors[m].numel() * tensors[m].element_size() for m in row[0])
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(row)
            size += nbytes
        os.makedirs(out, exist_ok=True)
        for name in os.listdir(tok_dir):
            if os.path.isfile(os.path.join(tok_dir, name)):
                shutil.copy2(os.path.join(tok_dir, name), os.path.join(out, name))
        names = [WEIGHTS] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map, total = {}, 0
        for name, shard in zip(names, shards):
            with _progress(len(shard), name) as bar, torch.no_grad():
                out_tensors = {}
                for mgs, hf_names, kind in shard:
                    for h, t in zip(hf_names, to_hf(kind, [tensors[m].detach() for m in mgs], c)):
                        out_tensors[h] = t.contiguous()
                        weight_map[h] = name
                        total += t.numel() * t.element_size()
                    if bar is not None:
                        bar.update(1)
                save_file(out_tensors, os.path.join(out, name), metadata={"format": "pt"})
                del out_tensors
        if len(names) > 1:
            with open(os.path.join(out, WEIGHTS_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        elif os.path.exists(os.path.join(out, WEIGHTS_INDEX)):
            os.remove(os.path.join(out, WEIGHTS_INDEX))
        return names


__all__ = ["import_hf", "export_hf"]
