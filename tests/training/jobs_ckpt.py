"""Checkpointing job functions, run on every rank of a persistent gloo world (see tests/dist.py)."""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os


@contextlib.contextmanager
def _may_start_processes():
    """The pool's workers are daemonic, and multiprocessing refuses to start children from a
    daemonic process; --async-save forks a writer process per save. Lifted for the job only."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def train(argv: list[str]) -> list[dict]:
    import train as entry

    with _may_start_processes():
        return entry.main(argv)


def train_with_crash_mid_save(argv: list[str], save_dir: str, crash_iteration: int, how: str) -> dict:
    """Run train.main(argv) with the checkpoint writer failing while it writes the checkpoint of
    `crash_iteration`, after its first item is on disk.

    how="raise": the write raises (an I/O error), inside megatron-core's writer.
    how="exit":  the writing process dies on the spot (os._exit); with --async-save that is the
                 forked writer process, so the trainer survives to see the failure.
    Returns what the run raised and what is on disk afterwards."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.api import CheckpointException

    original = filesystem_async._write_item
    target = f"iter_{crash_iteration:07d}"

    @functools.wraps(original)  # megatron inspects its signature (filesystem_async.py:390)
    def failing_write_item(*args, **kwargs):
        result = original(*args, **kwargs)
        stream = next(a for a in args if hasattr(a, "write") and hasattr(a, "name"))
        if target in str(stream.name):
            stream.flush()
            if how == "exit":
                os._exit(17)
            raise OSError(f"injected failure while writing {stream.name}")
        return result

    filesystem_async._write_item = failing_write_item
    error = None
    try:
        import train as entry

        with _may_start_processes():
            entry.main(argv)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        error = f"{type(e).__name__}: {e}"
    finally:
        filesystem_async._write_item = original
        from megatron_ext.training import parallel

        parallel.destroy()
    partial = os.path.join(save_dir, target + ".partial")
    return {
        "error": error,
        "listing": sorted(os.listdir(save_dir)),
        "partial_files": sorted(os.listdir(partial)) if os.path.isdir(partial) else None,
    }


@contextlib.contextmanager
def _captured_stdout(lines: list):
    """This rank's printed lines (the [checkpoint] lines are printed by rank 0 only)."""
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            yield
        finally:
            lines.extend(buffer.getvalue().splitlines())


def train_capturing(argv: list[str]) -> dict:
    """train.main(argv): its history, this rank's printed lines, and the one-line error it stopped
    with (a ConfigError, as train.py prints it) or the non-finite check's error."""
    import train as entry
    from megatron_ext.errors import ConfigError
    from megatron_ext.training.observability import NonFiniteLoss

    lines, history, error = [], None, None
    try:
        with _may_start_processes(), _captured_stdout(lines):
            history = entry.main(argv)
    except (ConfigError, NonFiniteLoss) as e:
        error = f"{type(e).__name__}: {e}"
    return {"history": history, "lines": lines, "error": error}


def train_saving_filled_params(argv: list[str], value: float) -> list[dict]:
    """train.main(argv) with every parameter (and the optimizer's moments) set to `value` just
    before each save: a checkpoint whose checksums are right but whose weights are not."""
    import torch

    import train as entry
    from megatron_ext.checkpoint import checkpointer as checkpointing

    original = checkpointing.Checkpointer.save

    def save(self, iteration):
        from megatron_ext.seams.checkpointing import _torch_optimizers

        with torch.no_grad():
            for chunk in self.model:
                for p in chunk.parameters():
                    p.fill_(value)
            for _, inner in _torch_optimizers(self.optimizer):  # Adam's moments too
                for state in inner.state.values():
                    for key, t in state.items():
                        if key != "step" and torch.is_tensor(t):
                            t.fill_(value)
        return original(self, iteration)

    checkpointing.Checkpointer.save = save
    try:
        with _may_start_processes():
            return entry.main(argv)
    finally:
        checkpointing.Checkpointer.save = original


# ---- damage, as file systems do it, applied to a copy of a checkpoint directory -----------------
def _flip(path: str, offset: int, count: int = 40) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0x5A for b in data))


def _largest_tensor_item(ckpt: str, name: str) -> tuple[int, int]:
    """(offset, length) of the largest item stored in file `name` (a tensor's bytes)."""
    import pickle

    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    items = [i for i in metadata.storage_data.values() if i.relative_path == name]
    item = max(items, key=lambda i: i.length)
    return item.offset, item.length


def _truncate_shard(root, ckpt):
    path = os.path.join(ckpt, "__1_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)  # a full disk or an interrupted copy


def _remove_shard(root, ckpt):
    os.remove(os.path.join(ckpt, "__0_0.distcp"))


def _change_tensor_bytes(root, ckpt):
    offset, length = _largest_tensor_item(ckpt, "__1_0.distcp")
    _flip(os.path.join(ckpt, "__1_0.distcp"), offset + length // 2)  # a few dozen bytes inside a tensor


def _damage_dcp_metadata(root, ckpt):
    _flip(os.path.join(ckpt, ".metadata"), os.path.getsize(os.path.join(ckpt, ".metadata")) // 2)


def _remove_metadata_json(root, ckpt):
    os.remove(os.path.join(ckpt, "metadata.json"))


def _change_recorded_checksum(root, ckpt):
    """Valid JSON, one digit of one recorded checksum changed."""
    import json

    path = os.path.join(ckpt, "metadata.json")
    with open(path) as f:
        config = json.load(f)
    entry = config["checksums"]["files"]["__0_0.distcp"]
    entry[1] = entry[1] ^ 1
    with open(path, "w") as f:
        json.dump(config, f)


def _damage_tracker(root, ckpt):
    """The marker garbled, and the checkpoint it pointed to gone."""
    import shutil

    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "wb") as f:
        f.write(b"\x00\x13\xff4")
    shutil.rmtree(ckpt)


def _strip_checksums(root, ckpt):
    """Checkpoints as saved before checksums were recorded (megatron-core's metadata.json only),
    the newest one with a truncated shard."""
    import json

    for name in os.listdir(root):
        path = os.path.join(root, name, "metadata.json")
        if os.path.exists(path):
            with open(path) as f:
                config = json.load(f)
            config.pop("checksums")
            with open(path, "w") as f:
                json.dump(config, f)
    _truncate_shard(root, ckpt)


DAMAGES = {
    "truncated-shard": (_truncate_shard, "__1_0.distcp truncated"),
    "missing-shard": (_remove_shard, "__0_0.distcp missing"),
    "changed-tensor-bytes": (_change_tensor_bytes, "__1_0.distcp checksum mismatch"),
    "damaged-dcp-metadata": (_damage_dcp_metadata, ".metadata checksum mismatch"),
    "missing-metadata-json": (_remove_metadata_json, "metadata.json missing"),
    "changed-recorded-checksum": (_change_recorded_checksum, "metadata.json checksum mismatch"),
    "damaged-latest-marker": (_damage_tracker, "latest_checkpointed_iteration.txt is damaged"),
    "no-checksums": (_strip_checksums, "__1_0.distcp truncated"),
    "no-fallback": (_truncate_shard, "__1_0.distcp truncated"),  # resumed with --no-ckpt-fallback
    "ckpt-step": (_truncate_shard, "__1_0.distcp truncated"),  # resumed with --ckpt-step of the damaged one
}


def save_recording_reads(argv: list[str], save: str) -> dict:
    """train.main(argv + --save): the history and the files the saves read back to checksum."""
    import train as entry
    from megatron_ext.checkpoint import integrity as ckpt_integrity

    read_back, original = [], ckpt_integrity.crc32_file

    def crc32_file(path):
        read_back.append(os.path.basename(path))
        return original(path)

    ckpt_integrity.crc32_file = crc32_file
    try:
        with _may_start_processes():
            history = entry.main(argv + ["--save", save])
    finally:
        ckpt_integrity.crc32_file = original
    return {"history": history, "read_back": sorted(set(read_back))}


def resume_recording_verified(argv: list[str]) -> dict:
    """train_capturing(argv), plus the files this rank's reads verified."""
    from megatron_ext.checkpoint import integrity as ckpt_integrity

    verified, original = [], ckpt_integrity.Verifier.verify_read

    def verify_read(self, names):
        verified.extend(names)
        return original(self, names)

    ckpt_integrity.Verifier.verify_read = verify_read
    try:
        out = train_capturing(argv)
    finally:
        ckpt_integrity.Verifier.verify_read = original
    out["verified"] = sorted(set(verified))
    return out
