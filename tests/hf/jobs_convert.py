"""Job functions of the parallel-conversion and self-describing-run tests (every rank of a gloo world,
tests/dist.py)."""
from __future__ import annotations

import contextlib

import arguments


@contextlib.contextmanager
def _bytes_read(counts: dict):
    """Count the bytes of every slice read from a safetensors file (safetensors' lazy reads)."""
    import safetensors

    original = safetensors.safe_open

    class Counted:
        def __init__(self, *args, **kwargs):
            self._f = original(*args, **kwargs)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def get_slice(self, name):
            sl = self._f.get_slice(name)

            class Slice:
                def __getattr__(self, attr):
                    return getattr(sl, attr)

                def __getitem__(self, index):
                    t = sl[index]
                    counts[name] = counts.get(name, 0) + t.numel() * t.element_size()
                    return t

            return Slice()

    safetensors.safe_open = Counted
    try:
        yield
    finally:
        safetensors.safe_open = original


def import_counting_reads(imports: list) -> dict:
    """Each (HF dir, checkpoint, layout flags) imported on this world; per import, the bytes this rank
    read from the HF files and the bytes of the model tensors it holds."""
    import torch

    from megatron_ext.hf import importer

    held = {}
    original = importer._fill

    def fill(pieces, *args):
        held["bytes"] = sum(p.dest.numel() * p.dest.element_size() for p in pieces)
        return original(pieces, *args)

    out = []
    importer._fill = fill
    try:
        for hf_dir, ckpt, flags in imports:
            counts: dict = {}
            with _bytes_read(counts):
                importer.import_hf(hf_dir, ckpt, extra=flags, parse=arguments.parse)
            out.append({"read": sum(counts.values()), "held": held["bytes"], "tensors": sorted(counts)})
    finally:
        importer._fill = original
    torch.distributed.barrier()
    return {"imports": out}


def plain_tensors(paths: list) -> list:
    """Every tensor of each checkpoint directory, whole, as bytes (dist_checkpointing's plain load:
    the checkpoint as any layout that loads it sees it)."""
    import torch
    from megatron.core import dist_checkpointing

    out = []
    for path in paths:
        loaded = dist_checkpointing.load_plain_tensors(path)
        out.append({k: (str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                    for k, v in loaded.items() if isinstance(v, torch.Tensor)})
    return out


def export_recording_stages(load: str, out: str, recipe: str | None = None, fail_after: int | None = None,
                            overwrite: bool = False, slow_rank: int | None = None) -> dict:
    """Export on this world; the HF tensors this rank wrote. fail_after: raise once this rank has
    written that many shard files (a failure part-way through); slow_rank: that rank starts writing
    half a second late (still writing when the others have failed)."""
    import time

    import torch
    from megatron_ext.errors import ConfigError
    from megatron_ext.hf import exporter

    written = []
    original = exporter._write_shards

    def write(files, names, tensors, c, target):
        if fail_after is not None:
            files, names = files[:fail_after], names[:fail_after]
        if slow_rank == torch.distributed.get_rank():
            time.sleep(0.5)
        result = original(files, names, tensors, c, target)
        written.extend(sorted(result[0]))
        if fail_after is not None:
            raise ConfigError("stopped part-way through the export")
        return result

    exporter._write_shards = write
    try:
        names, iteration = exporter.export_hf(load, out, recipe=recipe, max_shard_bytes=40 * 2**10, overwrite=overwrite,
                                              parse=arguments.parse)
        error = None
    except ConfigError as e:
        names, iteration, error = None, None, str(e)
    finally:
        exporter._write_shards = original
    return {"names": names, "iteration": iteration, "written": written, "error": error}


def import_refused(hf_dir: str, save: str, flags: list) -> str | None:
    """An import on this world: the line it refuses with (None: it did not)."""
    from megatron_ext.errors import ConfigError
    from megatron_ext.hf import importer

    try:
        importer.import_hf(hf_dir, save, extra=flags, parse=arguments.parse)
    except ConfigError as e:
        return str(e)
    return None


def import_overwriting(hf_dir: str, save: str) -> None:
    from megatron_ext.hf import importer

    importer.import_hf(hf_dir, save, overwrite=True, parse=arguments.parse)


def convert_cli(argv: list) -> str | None:
    """scripts/convert.py's main() in this process: None, or the one line it refuses with."""
    import importlib.util
    import os

    from megatron_ext.errors import ConfigError

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts",
                        "convert.py")
    spec = importlib.util.spec_from_file_location("convert_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        script.main(list(argv))
    except ConfigError as e:
        return str(e)
    return None


def train_then(argv: list | None, after: list) -> dict:
    """train.py's main() (unless argv is None), then each (name, scripts/convert.py argv) in this
    process: the iterations trained and what each conversion refused (None: done)."""
    import train as entry

    history = entry.main(list(argv)) if argv is not None else []
    return {"iterations": [h["iteration"] for h in history], **{name: convert_cli(a) for name, a in after}}


def conversions_counting_reads(conversions: list, peft: tuple | None = None) -> dict:
    """Each (name, command, --load, output) conversion on this world (command: ``hf`` or ``peft`` for
    scripts/convert.py export --hf / --peft, ``logits``), after ``peft`` = (HF dir, peft adapter, save)
    is imported when given. Per conversion, what it read of its --load directory (the directory and the
    checkpoints directly in it; an adapter's base elsewhere is not counted): ``read`` by anyone, and
    ``by the run`` (a frame of training/run.py on the stack: the run's parser, checks and load):
    each listing of the directory, each recipe.yaml opened, each read of a checkpoint's common state
    (torch's reader asked for the common_state object, whoever asks: megatron-core's load too), each
    read of a checkpoint's checksum manifest (metadata.json, ckpt_integrity.read_config); ``summed``:
    how often each file's checksum was taken; ``iteration``: the checkpoint loaded."""
    import builtins
    import collections
    import os
    import traceback

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from megatron_ext.hf import exporter, packed
    from megatron_ext.hf import peft as hf_peft
    from megatron_ext.checkpoint import integrity as ckpt_integrity

    if peft is not None:
        hf_peft.import_peft(*peft, parse=arguments.parse)
    run_py = os.path.join("megatron_ext", "training", "run.py")
    originals = (os.listdir, builtins.open, FileSystemReader.__dict__["read_data"], ckpt_integrity.read_config,
                 ckpt_integrity.crc32_file)
    listdir, opened, read_data, read_config, crc32_file = originals
    out = {}
    for name, command, load, target in conversions:
        root = os.path.abspath(load)
        read, by_run, summed = collections.Counter(), collections.Counter(), collections.Counter()

        def count(what: str) -> None:
            read[what] += 1
            if any(f.filename.endswith(run_py) for f in traceback.extract_stack()):
                by_run[what] += 1

        def checkpoint(path) -> bool:  # a checkpoint directly in --load
            return isinstance(path, (str, os.PathLike)) and os.path.dirname(os.path.abspath(path)) == root

        def counted_listdir(path="."):
            if isinstance(path, (str, os.PathLike)) and os.path.abspath(path) == root:
                count("listing")
            return listdir(path)

        def counted_open(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and os.path.basename(path) == "recipe.yaml" and (
                    os.path.dirname(os.path.abspath(path)) == root or checkpoint(os.path.dirname(path))):
                count("recipe")
            return opened(path, *args, **kwargs)

        def counted_read_data(self, plan, planner):
            if checkpoint(str(self.path)) and any(i.storage_index.fqn.startswith("common_state") for i in plan.items):
                count("common state")
            return read_data(self, plan, planner)

        def counted_read_config(directory):
            if checkpoint(directory):
                count("manifest")
            return read_config(directory)

        def counted_crc32_file(path):
            if checkpoint(os.path.dirname(path)):
                summed[os.path.basename(path)] += 1
            return crc32_file(path)

        os.listdir, builtins.open, FileSystemReader.read_data = counted_listdir, counted_open, counted_read_data
        ckpt_integrity.read_config, ckpt_integrity.crc32_file = counted_read_config, counted_crc32_file
        try:
            iteration = None
            if command == "hf":
                iteration = exporter.export_hf(load, target, parse=arguments.parse)[1]
            elif command == "peft":
                hf_peft.export_peft(load, target, parse=arguments.parse)
            else:
                packed.logits(load, [3, 17, 42], parse=arguments.parse)
        finally:
            os.listdir, builtins.open, FileSystemReader.read_data = originals[:3]
            ckpt_integrity.read_config, ckpt_integrity.crc32_file = originals[3:]
        out[name] = {"read": dict(read), "by the run": dict(by_run), "summed": dict(summed), "iteration": iteration}
    return out
