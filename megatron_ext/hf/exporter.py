"""Megatron checkpoint (any layout it was trained on) -> Hugging Face directory (scripts/convert.py export):
config.json, safetensors shards (and their index above one shard), the tokenizer files. An import's
config.json and tokenizer files go back as they came; a model trained from a recipe is written as the
family that represents it exactly (trained.py) with its tokenizer's files (tokenizer_files.py).

Under torchrun each rank is one pipeline stage: it loads the layers it owns, whole, and writes their HF
tensors into its own shard files; no rank holds more than its stage. A LoRA run's adapters are merged
into its base (lora.merge; its adapters alone go out in peft's format: peft.py). Written into a fresh
directory (or, with overwrite, a staging directory swapped in for the old one): nothing stale is left
beside the new shards. --load is read once before the run (checkpoint.find)."""
from __future__ import annotations

import json
import os
import shutil
import sys

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import checkpoint, families, hfdir, outputs, table, tokenizer_files, world


def export_hf(load: str, out: str, recipe: str | None = None, max_shard_bytes: int = 5 * 2**30,
              overwrite: bool = False, *, parse) -> tuple[list[str], int]:
    """Megatron checkpoint -> HF directory `out` (fresh, or with `overwrite` replaced as a whole);
    returns (the shard file names, the iteration exported). Under torchrun each rank is a pipeline
    stage and writes the shards of its layers. ``parse``: the entry point's argument layer
    (``arguments.parse``)."""
    outputs.check_fresh("--hf", out, overwrite, "an export")
    found = checkpoint.find(load, recipe)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    layout = stage_flags(found.num_layers(), processes)
    with checkpoint.loaded(found, ["--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1",
                                   "--context-parallel-size", "1", *layout], parse=parse) as run:
        from megatron_ext import lora

        args, model, iteration = run.args, run.model, run.checkpointer.loaded["iteration"]
        lora.merge(model)  # a LoRA run's adapters into its base weights (fp32), under the base's names
        tok_dir = args.tokenizer_model
        imported = checkpoint.imported(args)
        model_type, c = checkpoint.hf_config(args, load)  # an import's config, else the family of the recipe's model
        tensors = {}
        for piece in checkpoint.pieces(args, model):
            if piece.main:  # a tied output layer on the last stage is the first stage's embedding
                assert tuple(piece.whole.shape) == piece.shape, (piece.name, piece.whole.shape, piece.shape)
                tensors[piece.name] = piece.whole
        del model
        rows = table.expand(model_type, c, tensors)
        mine = _shard_rows(rows, tensors, max_shard_bytes)
        counts = [None] * processes
        torch.distributed.all_gather_object(counts, len(mine))
        total, first = sum(counts), sum(counts[:world.rank()])
        names = [hfdir.WEIGHTS] if total == 1 else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
        with outputs.fresh_directory(out, staged=True) as target:
            # agreed: a rank that fails is known to every rank once all have stopped writing, so the
            # staging directory is removed under no rank's open file
            weight_map, nbytes = world.agreed(lambda: _write_shards(mine, names[first:first + len(mine)], tensors, c,
                                                                    target))
            maps = [None] * processes
            torch.distributed.all_gather_object(maps, (weight_map, nbytes))
            unexported = None
            if world.rank() == 0:
                if imported:  # the import's HF directory, its weights aside
                    for name in os.listdir(tok_dir):
                        if os.path.isfile(os.path.join(tok_dir, name)):
                            shutil.copy2(os.path.join(tok_dir, name), os.path.join(target, name))
                else:  # a model trained from a recipe: its tokenizer's files, the config of its family
                    unexported = tokenizer_files.write(args, target)
                    with open(os.path.join(target, "config.json"), "w") as f:
                        json.dump(c.raw, f, indent=2, sort_keys=True)
                if total > 1:
                    merged = {k: v for m, _ in maps for k, v in m.items()}
                    with open(os.path.join(target, hfdir.WEIGHTS_INDEX), "w") as f:
                        json.dump({"metadata": {"total_size": sum(n for _, n in maps)},
                                   "weight_map": dict(sorted(merged.items()))}, f, indent=2)
        if unexported:  # the weights are written: the one line says what is not
            print(f"warning: {unexported}", file=sys.stderr, flush=True)
        return names, iteration


def stage_flags(num_layers: int, processes: int) -> list[str]:
    """One pipeline stage per process, the layers as even as megatron's split allows (an uneven
    first and last stage around even middle ones)."""
    if processes == 1:
        return []
    if num_layers < processes:
        raise ConfigError(f"an export under {processes} processes gives each a pipeline stage of whole layers, and "
                          f"the model has {num_layers}: run at most {num_layers} processes")
    flags = ["--pipeline-model-parallel-size", str(processes)]
    if num_layers % processes == 0:
        return flags
    if processes == 2:
        first = -(-num_layers // 2)
        return flags + ["--decoder-first-pipeline-num-layers", str(first),
                        "--decoder-last-pipeline-num-layers", str(num_layers - first)]
    for middle in range(-(-num_layers // processes), 0, -1):
        ends = num_layers - middle * (processes - 2)
        if ends >= 2:
            first = -(-ends // 2)
            return flags + ["--decoder-first-pipeline-num-layers", str(first),
                            "--decoder-last-pipeline-num-layers", str(ends - first)]
    raise AssertionError((num_layers, processes))


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
    progress = world.Progress(sum(len(f) for f in files), "export")
    for name, rows in zip(names, files):
        out_tensors, written = {}, []
        with torch.no_grad():
            for mgs, hf_names, kind in rows:
                ts = [tensors.pop(m).detach() for m in mgs]
                hf = table.converted_to_hf(kind, ts, c)
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
