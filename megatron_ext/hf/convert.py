"""Hugging Face <-> megatron checkpoints, through the model megatron-core builds from the recipe.

import: HF directory -> CKPT/recipe.yaml (every architecture flag the config implies), CKPT/tokenizer/
        (the HF directory without its weights: tokenizer files, config.json, generation_config.json),
        CKPT/iter_0000000 (the project's torch_dist checkpoint, model weights only, with the recipe it
        records; dist_checkpointing reshards it into any layout). On one process or under torchrun in
        any layout: each rank builds its shard of the model (megatron-core's partitioning) and reads
        only the slices of the HF tensors that shard holds (shards.py), one HF tensor at a time, so
        its peak host memory is its shard plus one tensor's slice; dist_checkpointing writes the
        checkpoint a one-process import writes.
export: CKPT (any layout it was trained on) -> config.json, safetensors shards (and their index above
        one shard), tokenizer files. Under torchrun each rank is one pipeline stage: it loads the
        layers it owns, whole, and writes their HF tensors into its own shard files; no rank holds
        more than its stage. Written into a fresh directory (or, with overwrite, a staging directory
        swapped in for the old one): nothing stale is left beside the new shards.
A LoRA run loads its base and adapters as its checkpoint records them and exports merged (lora.merge;
its adapters alone go out in peft's format: peft.py); the logits of sequences packed into one
forward, on any layout (torchrun): packed.py.

A checkpoint saved by train.py records its recipe (training/ckpt_recipe.py): export and logits read
it when no recipe is given. Nothing is left behind by a failure: an import removes what it wrote (and
puts back the directory --overwrite moved aside), an export its staging directory, logits its file.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families, shards

WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
RECIPE = "recipe.yaml"
TOKENIZER = "tokenizer"
SIDE_FILES_SKIPPED = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", WEIGHTS_INDEX)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_FLAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
STAGING = ".partial"  # OUT.partial: an export being written
REPLACED = ".replaced"  # PATH.replaced: what --overwrite moved aside until the new one is complete


# ---------------------------------------------------------------------------------------------
# the HF directory
# ---------------------------------------------------------------------------------------------
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


def read_hf_config(hf_dir: str) -> tuple[str, families.Config]:
    raw = read_json(f"--hf={hf_dir}", hf_dir, "config.json", "a Hugging Face model directory")
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
    # the layer spec is the platform's (megatron's default transformer_engine where it imports, else
    # local: megatron_ext/platform/target.py); the checkpoint loads into either (training/te_names.py)
    out.pop("transformer_impl", None)
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


class _Progress:
    """Tensors done / total and the bytes per second, on stderr of rank 0, on a terminal (or with
    MEGATRON_EXT_PROGRESS=1): a 70B conversion takes minutes."""

    def __init__(self, total: int, desc: str):
        self.bar, self.bytes, self.t0 = None, 0, time.perf_counter()
        if int(os.environ.get("RANK", "0")) == 0 and (sys.stderr.isatty() or os.environ.get("MEGATRON_EXT_PROGRESS")):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bytes += nbytes
            rate = self.bytes / max(time.perf_counter() - self.t0, 1e-9) / 2**20
            self.bar.set_postfix_str(f"{self.bytes / 2**20:.0f} MiB, {rate:.0f} MiB/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# the megatron model of a recipe, on one process or under torchrun
# ---------------------------------------------------------------------------------------------
def open_run(recipe: str | None, extra: list[str]):
    """The run of the recipe's model (None: the recipe the --load checkpoint in `extra` records), one
    micro-batch of mock data (megatron_ext/training/run.py): what import, export and logits build and
    load through. Entering it brings the process groups up; leaving it tears them down, and a
    teardown that fails after the conversion's own error does not replace it."""
    from megatron_ext.training.run import Run

    argv = [*(["--recipe", recipe] if recipe else []), "--mock-data", "--micro-batch-size", "1", "--train-iters", "1",
            "--lr", "0", "--num-workers", "0", *extra]
    if "--global-batch-size" not in extra:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        argv += ["--global-batch-size", "1"] if world == 1 else []
    return Run.from_argv(argv)


def model_tensors(chunk) -> dict[str, torch.Tensor]:
    """Parameter and persistent-buffer tensors of one model chunk by state-dict name."""
    from megatron_ext.seams import unwrapped

    return {k: v for k, v in unwrapped(chunk).state_dict(keep_vars=True).items()
            if "_extra_state" not in k and isinstance(v, torch.Tensor)}


def _setup() -> None:
    """The platform, before anything imports megatron-core (its CPU shims)."""
    from megatron_ext import platform

    platform.setup()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _agreed(step):
    """step() on every rank; a refusal on any rank is raised on every rank (the lowest rank's line),
    so no rank waits in a collective its peers never reach."""
    error, out = None, None
    try:
        out = step()
    except ConfigError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable file on one rank must not leave the others waiting
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first)
    return out


def _pieces(args, model) -> list:
    from megatron_ext.training import ckpt_state

    return shards.pieces(model, ckpt_state.sharding_metadata(args))


# ---------------------------------------------------------------------------------------------
# the table, expanded for one model
# ---------------------------------------------------------------------------------------------
def table_rows(model_type: str, c: families.Config):
    """The family's table with {L} and {E} filled in for every layer and expert of the config: rows of
    (megatron names, HF names, transform); a stacked row has one megatron name per expert."""
    layers = c["num_hidden_layers"]
    experts = c.raw.get("num_experts") or c.raw.get("num_local_experts") or c.raw.get("n_routed_experts") or 0
    for mg, hf, kind in families.TABLES[model_type]:
        stacked = kind.startswith("stacked")
        for layer in range(layers) if "{L}" in mg else [None]:
            for expert in range(experts) if "{E}" in mg and not stacked else [None]:
                def fill(s, e=expert):
                    return s.replace("{L}", str(layer)).replace("{E}", str(e))
                yield (tuple(fill(mg, e) for e in range(experts)) if stacked else (fill(mg),)), [fill(h) for h in hf], kind


def expand(model_type: str, c: families.Config, names) -> list[tuple[tuple[str, ...], list[str], str]]:
    """The table's rows (table_rows) kept where the model has the megatron names; every name covered."""
    rows = [row for row in table_rows(model_type, c) if all(m in names for m in row[0])]
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
    if not kind.startswith("stacked"):
        return [shards.join(kind, parts, _head_dim(c))]
    (t,) = parts
    if kind == "stacked_glu_t":  # [E, h, 2f] -> [2f, h] each
        return [torch.cat(_interleaved(e), -1).t() for e in t]
    if kind == "stacked_glu":  # [E, 2f] -> [2f] each
        return [torch.cat(_interleaved(e), -1) for e in t]
    if kind == "stacked_t":  # [E, f, h] -> [h, f] each
        return [e.t() for e in t]
    assert kind == "stacked", kind
    return list(t)


def to_hf(kind: str, ts: list[torch.Tensor], c: families.Config, hf_shapes: list) -> list[torch.Tensor]:
    """One row's megatron tensors -> its HF tensors of `hf_shapes` (the inverse of to_megatron)."""
    if not kind.startswith("stacked"):
        return shards.split(kind, ts[0], hf_shapes, _head_dim(c))
    if kind == "stacked_glu_t":
        return [torch.stack([_interleave(*t.t().chunk(2, -1)) for t in ts])]
    if kind == "stacked_glu":
        return [torch.stack([_interleave(*t.chunk(2, -1)) for t in ts])]
    if kind == "stacked_t":
        return [torch.stack([t.t() for t in ts])]
    assert kind == "stacked", kind
    return [torch.stack(ts)]


def hf_shapes(kind: str, mg_shapes: list, c: families.Config) -> list[tuple]:
    """The HF tensors' shapes of a row whose megatron tensors have `mg_shapes`."""
    d = _head_dim(c)
    if kind == "copy":
        return [tuple(mg_shapes[0])]
    if kind == "glu":
        return [(mg_shapes[0][0] // 2, *mg_shapes[0][1:])] * 2
    if kind == "qkv":
        heads, groups = c.raw["num_attention_heads"], c.raw.get("num_key_value_heads") or c.raw["num_attention_heads"]
        return [(heads * d, *mg_shapes[0][1:]), (groups * d, *mg_shapes[0][1:]), (groups * d, *mg_shapes[0][1:])]
    meta = to_hf(kind, [torch.empty(s, device="meta") for s in mg_shapes], c, [])
    return [tuple(t.shape) for t in meta]


def _head_dim(c: families.Config) -> int:
    return c.raw.get("head_dim") or c.raw["hidden_size"] // c.raw["num_attention_heads"]


# ---------------------------------------------------------------------------------------------
# output directories: fresh, or replaced as a whole; nothing left behind by a failure
# ---------------------------------------------------------------------------------------------
def _check_fresh(flag: str, path: str, overwrite: bool, what: str) -> None:
    """Before any work: `path` must be new or empty, unless --overwrite (every rank, the same answer)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}={path}: not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConfigError(f"{flag}={path}: not empty ({what} writes a fresh directory; --overwrite replaces it "
                          "as a whole)")


@contextlib.contextmanager
def _fresh_directory(path: str, staged: bool):
    """Yield where to write `path` (collective; rank 0 moves directories). Staged: into PATH.partial,
    swapped in for `path` once complete. Not staged (an import: the checkpoint's recorded paths
    name `path`): into `path` itself, an old one moved aside to PATH.replaced first. On success
    what was moved aside is removed; on failure what was written is removed and the old one put back."""
    target = path + STAGING if staged else path
    old = path + REPLACED
    main = _rank() == 0
    if main:
        for leftover in (target, old) if staged else (old,):  # of a killed earlier run
            if os.path.isdir(leftover):
                shutil.rmtree(leftover)
        if not staged and os.path.isdir(path):
            os.replace(path, old)
        os.makedirs(target, exist_ok=True)
    torch.distributed.barrier()
    try:
        yield target
        torch.distributed.barrier()  # every rank's files are written
        if main:
            if staged:
                if os.path.isdir(path):
                    os.replace(path, old)
                os.replace(target, path)
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if main:
            shutil.rmtree(target, ignore_errors=True)
            if os.path.isdir(old) and not os.path.exists(path):
                os.replace(old, path)
        raise


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------
def import_hf(hf_dir: str, save: str, extra: list[str] = (), overwrite: bool = False) -> str:
    """HF directory -> megatron checkpoint under `save` (a fresh directory, or with `overwrite` a
    replaced one), on this process's layout (`extra`: its flags; under torchrun every rank reads only
    its shard's slices); returns the recipe's path."""
    _setup()
    model_type, c = read_hf_config(hf_dir)
    files = shard_files(hf_dir)
    _check_fresh("--save", save, overwrite, "an import")
    inventory = _inventory(hf_dir, files)
    tokenizer_vocab = _tokenizer_vocab(hf_dir)
    flags = recipe_for(model_type, c, save, tokenizer_vocab)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # parsed with the tokenizer where it is now; the recipe written names the copy under `save`
    handle, parsed = tempfile.mkstemp(suffix=".yaml", prefix="import-recipe-")
    os.close(handle)
    try:
        write_recipe(parsed, dict(flags, tokenizer_model=os.path.abspath(hf_dir)), model_type)
        run = open_run(parsed, ["--save", save, "--save-interval", "1", "--no-save-optim", "--no-save-rng",
                                "--world-size", str(world), "--global-batch-size", str(parallel_dp(world, extra)),
                                *extra])
    finally:
        os.remove(parsed)
    recipe = os.path.join(save, RECIPE)
    args = run.args
    with run:
        model = run.build(wrap=False)
        if args.padded_vocab_size != c["vocab_size"]:
            raise ConfigError(f"config.json: vocab_size={c['vocab_size']}: megatron pads the tokenizer's "
                              f"{tokenizer_vocab} ids to {args.padded_vocab_size}")
        pieces = _pieces(args, model)
        rows = _agreed(lambda: _rows_of_all_ranks(model_type, c, pieces, hf_dir, inventory))
        with _fresh_directory(save, staged=False):
            if _rank() == 0:
                shutil.copytree(hf_dir, os.path.join(save, TOKENIZER),
                                ignore=lambda d, names: [n for n in names if n.endswith(SIDE_FILES_SKIPPED)])
                write_recipe(recipe, dict(flags), model_type)
            _agreed(lambda: _fill(pieces, rows, c, hf_dir, inventory))
            del pieces
            from megatron_ext.training import ckpt_state

            saved = [shards.Prebuilt(c, ckpt_state.sharding_metadata(args), own_storage=True) for c in model]
            run.save(0, weights_only=True, chunks=saved)
    return recipe


def _inventory(hf_dir: str, files: list[str]) -> dict[str, tuple[str, tuple, str]]:
    """Every HF tensor: (its file, shape, safetensors dtype), from the files' headers."""
    from safetensors import safe_open

    found = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        with safe_open(path, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                found[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
    return found


def _rows_of_all_ranks(model_type: str, c: families.Config, pieces: list, hf_dir: str, inventory: dict) -> list:
    """The table rows of the whole model (every rank's tensors), checked against the HF tensors:
    none missing, none the model does not have."""
    names = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted({p.name for p in pieces}))
    rows = expand(model_type, c, {n for ns in names for n in ns})
    wanted = {h for row in rows for h in row[1]}
    extra = [k for k in inventory if k not in wanted]
    if extra:
        raise ConfigError(f"{inventory[extra[0]][0]}: tensor {extra[0]} is not part of a {model_type} model with this "
                          "config")
    missing = [h for h in (h for row in rows for h in row[1]) if h not in inventory]
    if missing:
        raise ConfigError(f"--hf={hf_dir}: tensor {missing[0]} is missing from the shards")
    return rows


def _fill(pieces: list, rows: list, c: families.Config, hf_dir: str, inventory: dict) -> None:
    """Every piece from the slices of the HF tensors it covers, one HF tensor at a time (its file
    opened for that tensor alone: the mapped pages of what was read go with it)."""
    from safetensors import safe_open

    row_of = {m: row for row in rows for m in row[0]}
    by_tensor: dict[str, list] = {}  # HF name -> [(its slices, the piece, the piece's slices, the row)]
    for piece in pieces:
        mgs, hf_names, kind = row_of[piece.name]
        path = inventory[hf_names[0]][0]
        shapes = [inventory[h][1] for h in hf_names]
        _check_row(piece, mgs, hf_names, kind, shapes, c, path)
        if kind.startswith("stacked"):  # this expert's entry, transformed whole, then the piece's part
            expert = mgs.index(piece.name)
            by_tensor.setdefault(hf_names[0], []).append(((slice(expert, expert + 1),), piece, None, kind))
        else:
            for i, hf_slices, dest_slices in shards.reads(kind, shapes, _head_dim(c), piece):
                by_tensor.setdefault(hf_names[i], []).append((hf_slices, piece, dest_slices, kind))
    progress = _Progress(len(by_tensor), "import")
    with torch.no_grad():
        for name in sorted(by_tensor, key=lambda n: (inventory[n][0], n)):
            path, _, dtype = inventory[name]
            with safe_open(path, "pt") as f:
                tensor = f.get_slice(name)
                nbytes = 0
                for hf_slices, piece, dest_slices, kind in by_tensor[name]:
                    if SAFETENSORS_DTYPES.get(dtype) != piece.dest.dtype:
                        raise ConfigError(f"{path}: {name}: dtype {_dtype_name(SAFETENSORS_DTYPES.get(dtype, dtype))} "
                                          f"does not match the config's {_dtype_name(piece.dest.dtype)}")
                    value = tensor[hf_slices]
                    nbytes += value.numel() * value.element_size()
                    if dest_slices is None:
                        piece.dest.copy_(to_megatron(kind, [value], c)[0][piece.slices])
                    else:
                        piece.dest[dest_slices].copy_(value)
                    del value
            progress.update(nbytes)
    progress.close()


def _check_row(piece, mgs: tuple, hf_names: list, kind: str, shapes: list, c: families.Config, path: str) -> None:
    """The HF tensors' shapes make the megatron tensor the config describes."""
    if kind.startswith("stacked") and (len(shapes[0]) < 1 or shapes[0][0] != len(mgs)):
        raise ConfigError(f"{path}: {hf_names[0]}: shape {shapes[0]} does not match the config's "
                          f"{len(mgs)} experts")
    try:
        meta = to_megatron(kind, [torch.empty(s, device="meta") for s in shapes], c)[0]
        shape = tuple(meta.shape)
    except RuntimeError:  # parts that do not concatenate
        shape = tuple(tuple(s) for s in shapes)
    if shape != piece.shape:
        raise ConfigError(f"{path}: {', '.join(hf_names)}: shape {shape} does not match the config's "
                          f"{piece.shape} ({piece.name})")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


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
def recipe_of(load: str, recipe: str | None) -> str:
    """The recipe a load reads: `recipe`, else the one the checkpoint records (or an import's beside
    it); a one-line refusal when there is none."""
    if recipe:
        if not os.path.isfile(recipe):
            raise ConfigError(f"--recipe={recipe}: no such file")
        return recipe
    if not os.path.isdir(load):
        raise ConfigError(f"--load={load}: no such directory")
    from megatron_ext.training import ckpt_recipe

    found = ckpt_recipe.recorded(load)
    if found is None:
        raise ConfigError(f"--load={load}: no {RECIPE} there, in its checkpoints or beside them (a checkpoint "
                          "train.py saves records one, an import writes one): pass --recipe")
    return found


@contextlib.contextmanager
def loaded_model(load: str, recipe: str | None, extra: list[str]):
    """The run of `recipe` (default: the one the checkpoint records) with the newest intact
    checkpoint under `load` loaded, weights only, as --finetune loads them (``run.model``;
    ``run.checkpointer.loaded["iteration"]``: the one loaded). A LoRA adapter checkpoint loads with
    the LoRA flags it records, its base first (training/ckpt_lora.py)."""
    from megatron_ext.hf import peft

    recipe_of(load, recipe)  # refused at once when there is none; the parser reads (and relocates) it
    with open_run(recipe, ["--load", load, "--finetune", "--no-load-optim", "--no-load-rng",
                           "--exit-on-missing-checkpoint", *peft.recorded_lora_flags(load), *extra]) as run:
        from megatron_ext import lora
        from megatron_ext.training import ckpt_state

        model = run.build(wrap=False)
        # the model's own tensors are loaded into in place (shards.py); a LoRA load places a part of
        # the model's keys (the base, then the adapters) through the model itself
        loaded = None if lora.enabled(run.args) else [
            shards.Prebuilt(c, ckpt_state.sharding_metadata(run.args), own_storage=False) for c in model]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                run.load(weights_only=True, chunks=loaded)
        except ConfigError as e:  # the damage each checkpoint showed, in the one line
            found = [line.removeprefix("[checkpoint] ") for line in printed.getvalue().splitlines() if "damaged" in line]
            raise ConfigError("; ".join([str(e), *found])) from None
        for line in printed.getvalue().splitlines():  # what was loaded instead of a damaged newer checkpoint
            if "damaged" in line or "warning" in line:
                print(line, file=sys.stderr, flush=True)
        yield run


def loaded_hf_config(args, load: str) -> tuple[str, families.Config]:
    """(model type, HF config) of a loaded run: its tokenizer directory's config.json, which an import
    copies there; a model that came from no import has none to write."""
    tok_dir = args.tokenizer_model
    if not isinstance(tok_dir, str) or not os.path.isfile(os.path.join(tok_dir, "config.json")):
        raise ConfigError(f"--load={load}: not a model imported from Hugging Face (its tokenizer {tok_dir} has no "
                          "config.json, the architecture a Hugging Face model is written with)")
    return read_hf_config(tok_dir)


def stage_flags(num_layers: int, world: int) -> list[str]:
    """One pipeline stage per process, the layers as even as megatron's split allows (an uneven
    first and last stage around even middle ones)."""
    if world == 1:
        return []
    if num_layers < world:
        raise ConfigError(f"an export under {world} processes gives each a pipeline stage of whole layers, and "
                          f"the model has {num_layers}: run at most {num_layers} processes")
    flags = ["--pipeline-model-parallel-size", str(world)]
    if num_layers % world == 0:
        return flags
    if world == 2:
        first = -(-num_layers // 2)
        return flags + ["--decoder-first-pipeline-num-layers", str(first),
                        "--decoder-last-pipeline-num-layers", str(num_layers - first)]
    for middle in range(-(-num_layers // world), 0, -1):
        ends = num_layers - middle * (world - 2)
        if ends >= 2:
            first = -(-ends // 2)
            return flags + ["--decoder-first-pipeline-num-layers", str(first),
                            "--decoder-last-pipeline-num-layers", str(ends - first)]
    raise AssertionError((num_layers, world))


def _recipe_layers(recipe: str) -> int:
    import yaml

    with open(recipe) as f:
        raw = yaml.safe_load(f) or {}
    layers = raw.get("num_layers", raw.get("num-layers"))
    if not isinstance(layers, int):
        raise ConfigError(f"--recipe={recipe}: no num_layers")
    return layers


def export_hf(load: str, out: str, recipe: str | None = None, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False) -> tuple[list[str], int]:
    """Megatron checkpoint -> HF directory `out` (fresh, or with `overwrite` replaced as a whole);
    returns (the shard file names, the iteration exported). Under torchrun each rank is a pipeline
    stage and writes the shards of its layers."""
    _setup()
    _check_fresh("--hf", out, overwrite, "an export")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout = stage_flags(_recipe_layers(recipe_of(load, recipe)), world)
    with loaded_model(load, recipe, [
            "--world-size", str(world), "--global-batch-size", "1", "--tensor-model-parallel-size", "1",
            "--expert-model-parallel-size", "1", "--context-parallel-size", "1", *layout]) as run:
        from megatron_ext import lora

        args, model, iteration = run.args, run.model, run.checkpointer.loaded["iteration"]
        lora.merge(model)  # a LoRA run's adapters into its base weights (fp32), under the base's names
        tok_dir = args.tokenizer_model
        model_type, c = loaded_hf_config(args, load)
        tensors = {}
        for piece in _pieces(args, model):
            if piece.main:  # a tied output layer on the last stage is the first stage's embedding
                assert tuple(piece.whole.shape) == piece.shape, (piece.name, piece.whole.shape, piece.shape)
                tensors[piece.name] = piece.whole
        del model
        rows = expand(model_type, c, tensors)
        mine = _shard_rows(rows, tensors, max_shard_bytes)
        counts = [None] * world
        torch.distributed.all_gather_object(counts, len(mine))
        total, first = sum(counts), sum(counts[:_rank()])
        names = [WEIGHTS] if total == 1 else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
        with _fresh_directory(out, staged=True) as target:
            # agreed: a rank that fails is known to every rank once all have stopped writing, so the
            # staging directory is removed under no rank's open file
            weight_map, nbytes = _agreed(lambda: _write_shards(mine, names[first:first + len(mine)], tensors, c, target))
            maps = [None] * world
            torch.distributed.all_gather_object(maps, (weight_map, nbytes))
            if _rank() == 0:
                for name in os.listdir(tok_dir):
                    if os.path.isfile(os.path.join(tok_dir, name)):
                        shutil.copy2(os.path.join(tok_dir, name), os.path.join(target, name))
                if total > 1:
                    merged = {k: v for m, _ in maps for k, v in m.items()}
                    with open(os.path.join(target, WEIGHTS_INDEX), "w") as f:
                        json.dump({"metadata": {"total_size": sum(n for _, n in maps)},
                                   "weight_map": dict(sorted(merged.items()))}, f, indent=2)
        return names, iteration


def _shard_rows(rows: list, tensors: dict, max_shard_bytes: int) -> list[list]:
    """This rank's rows in shard files: consecutive rows until the next would pass max_shard_bytes."""
    files, size = [], 0
    for row in rows:
        nbytes = sum(tensors[m].numel() * tensors[m].element_size() for m in row[0])
        if not files or (files[-1] and size + nbytes > max_shard_bytes):
            files.append([])
            size = 0
        files[-1].append(row)
        size += nbytes
    return files


def _write_shards(files: list, names: list, tensors: dict, c: families.Config, target: str) -> tuple[dict, int]:
    """Each file's HF tensors, converted row by row; a megatron tensor is freed once converted (or,
    when the HF tensor is the same storage, once its file is written): the rank's stage, plus one row."""
    from safetensors.torch import save_file

    weight_map, total = {}, 0
    progress = _Progress(sum(len(f) for f in files), "export")
    for name, rows in zip(names, files):
        out_tensors, written = {}, []
        with torch.no_grad():
            for mgs, hf_names, kind in rows:
                ts = [tensors.pop(m).detach() for m in mgs]
                hf = to_hf(kind, ts, c, hf_shapes(kind, [t.shape for t in ts], c))
                kept = {h.untyped_storage().data_ptr() for h in hf}
                for h_name, t in zip(hf_names, hf):
                    out_tensors[h_name] = t.contiguous()
                    weight_map[h_name] = name
                    total += t.numel() * t.element_size()
                for t in ts:
                    if t.untyped_storage().data_ptr() in kept:
                        written.append(t)  # the HF tensor is this storage: freed once its file is written
                    else:
                        _release(t)
                progress.update(sum(t.numel() * t.element_size() for t in hf))
                del ts, hf
        save_file(out_tensors, os.path.join(target, name), metadata={"format": "pt"})
        del out_tensors
        for t in written:
            _release(t)
    progress.close()
    return weight_map, total


def _release(t: torch.Tensor) -> None:
    """Free a converted tensor's memory (its storage emptied in place: the model still refers to it)."""
    t.untyped_storage().resize_(0)


# ---------------------------------------------------------------------------------------------
# logits (packed.py runs the forward)
# ---------------------------------------------------------------------------------------------
def save_logits(tensor: torch.Tensor, path: str) -> None:
    """torch.save into a temporary file renamed into place: a failed write leaves no partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(tensor, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def layout_flag(extra: list[str], name: str, default: int = 1) -> int:
    """A parallel size among layout flags given as a list (``--tensor-model-parallel-size 2``)."""
    return int(extra[extra.index(name) + 1]) if name in extra else default


def parallel_dp(world: int, extra: list[str]) -> int:
    """The data-parallel size of a layout given as flags (the global batch must be a multiple)."""
    return max(1, world // (layout_flag(extra, "--tensor-model-parallel-size")
                            * layout_flag(extra, "--pipeline-model-parallel-size")
                            * layout_flag(extra, "--context-parallel-size")))


__all__ = ["import_hf", "export_hf", "save_logits"]
