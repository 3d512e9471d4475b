"""Hugging Face directory -> megatron checkpoint (scripts/convert.py import).

    CKPT/recipe.yaml      every architecture flag the config implies, the dtype, the tokenizer
    CKPT/tokenizer/       the HF directory without its weights (tokenizer files, config.json,
                          generation_config.json: what an export writes back)
    CKPT/iter_0000000/    the project's torch_dist checkpoint, model weights only, with the recipe it
                          records; dist_checkpointing reshards it into any layout

On one process or under torchrun in any layout: each rank builds its shard of the model (the run's
model-only bring-up: megatron-core's partitioning) and reads only the slices of the HF tensors that
shard holds (shards.py), one HF tensor at a time, so its peak host memory is its shard plus one
tensor's slice; dist_checkpointing writes the checkpoint a one-process import writes. An import
writes a fresh --save (--overwrite: the old one is put back if it fails)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import checkpoint, families, hfdir, outputs, shards, table, world

TOKENIZER = "tokenizer"  # CKPT/tokenizer, as checkpoint/recipe.py names a checkpoint's copy
DTYPE_FLAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def import_hf(hf_dir: str, save: str, extra: list[str] = (), overwrite: bool = False, *, parse) -> str:
    """HF directory -> megatron checkpoint under `save` (a fresh directory, or with `overwrite` a
    replaced one), on this process's layout (`extra`: its flags; under torchrun every rank reads only
    its shard's slices); returns the recipe's path. ``parse``: the entry point's argument layer
    (``arguments.parse``)."""
    from megatron_ext import platform

    platform.setup()
    model_type, c = hfdir.read_config(hf_dir)
    outputs.check_fresh("--save", save, overwrite, "an import")  # before the shards' headers are read
    inventory = hfdir.tensors(hf_dir)
    tokenizer_vocab = hfdir.tokenizer_vocab(hf_dir)
    flags = recipe_for(model_type, c, save, tokenizer_vocab)
    # parsed with the tokenizer where it is now; the recipe written names the copy under `save`
    handle, parsed = tempfile.mkstemp(suffix=".yaml", prefix="import-recipe-")
    os.close(handle)
    try:
        write_recipe(parsed, dict(flags, tokenizer_model=os.path.abspath(hf_dir)), model_type)
        run = checkpoint.open_model(parsed, ["--save", save, "--save-interval", "1", "--no-save-optim",
                                             "--no-save-rng", *extra], parse=parse)
    finally:
        os.remove(parsed)
    recipe = os.path.join(save, checkpoint.RECIPE)
    args = run.args
    with run:
        model = run.build()
        if args.padded_vocab_size != c["vocab_size"]:
            raise ConfigError(f"config.json: vocab_size={c['vocab_size']}: megatron pads the tokenizer's "
                              f"{tokenizer_vocab} ids to {args.padded_vocab_size}")
        pieces = checkpoint.pieces(args, model)
        rows = world.agreed(lambda: _rows_of_all_ranks(model_type, c, pieces, hf_dir, inventory))
        with outputs.fresh_directory(save, staged=False):
            if world.rank() == 0:
                shutil.copytree(hf_dir, os.path.join(save, TOKENIZER),
                                ignore=lambda d, names: [n for n in names if n.endswith(hfdir.WEIGHT_FILES)])
                _record_source(os.path.join(save, TOKENIZER), hf_dir)
                write_recipe(recipe, dict(flags), model_type)
            world.agreed(lambda: _fill(pieces, rows, c, hf_dir, inventory))
            del pieces
            run.save(0, weights_only=True, chunks=checkpoint.prebuilt(args, model, own_storage=True))
    return recipe


def _record_source(copy: str, hf_dir: str) -> None:
    """The copy's config.json names the model it came from, as transformers' ``_name_or_path`` (what an
    adapter export gives peft as base_model_name_or_path: hfdir.imported_from)."""
    path = os.path.join(copy, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[hfdir.NAME_OR_PATH] = hfdir.name_or_path(hf_dir)
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# ---------------------------------------------------------------------------------------------
# the recipe
# ---------------------------------------------------------------------------------------------
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
    # local: megatron_ext/platform/target.py); the checkpoint loads into either (checkpoint/te_names.py)
    out.pop("transformer_impl", None)
    dtype = hfdir.config_dtype(c)
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


# ---------------------------------------------------------------------------------------------
# the weights
# ---------------------------------------------------------------------------------------------
def _rows_of_all_ranks(model_type: str, c: families.Config, pieces: list, hf_dir: str, inventory: dict) -> list:
    """The table rows of the whole model (every rank's tensors), checked against the HF tensors:
    none missing, none the model does not have."""
    names = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted({p.name for p in pieces}))
    rows = table.expand(model_type, c, {n for ns in names for n in ns})
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
            for i, hf_slices, dest_slices in shards.reads(kind, shapes, table.head_dim(c), piece):
                by_tensor.setdefault(hf_names[i], []).append((hf_slices, piece, dest_slices, kind))
    progress = world.Progress(len(by_tensor), "import")
    with torch.no_grad():
        for name in sorted(by_tensor, key=lambda n: (inventory[n][0], n)):
            path, _, dtype = inventory[name]
            with safe_open(path, "pt") as f:
                tensor = f.get_slice(name)
                nbytes = 0
                for hf_slices, piece, dest_slices, kind in by_tensor[name]:
                    if hfdir.SAFETENSORS_DTYPES.get(dtype) != piece.dest.dtype:
                        raise ConfigError(f"{path}: {name}: dtype "
                                          f"{_dtype_name(hfdir.SAFETENSORS_DTYPES.get(dtype, dtype))} "
                                          f"does not match the config's {_dtype_name(piece.dest.dtype)}")
                    value = tensor[hf_slices]
                    nbytes += value.numel() * value.element_size()
                    if dest_slices is None:
                        piece.dest.copy_(table.to_megatron(kind, [value], c)[0][piece.slices])
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
        meta = table.to_megatron(kind, [torch.empty(s, device="meta") for s in shapes], c)[0]
        shape = tuple(meta.shape)
    except RuntimeError:  # parts that do not concatenate
        shape = tuple(tuple(s) for s in shapes)
    if shape != piece.shape:
        raise ConfigError(f"{path}: {', '.join(hf_names)}: shape {shape} does not match the config's "
                          f"{piece.shape} ({piece.name})")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
