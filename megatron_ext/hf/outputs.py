"""What a conversion writes, never partial: a fresh output directory (with --overwrite, one replaced as
a whole) and a file renamed into place. A failure leaves nothing behind; what a killed process left
(OUT.partial, PATH.replaced) is removed by the next run."""
from __future__ import annotations

import contextlib
import os
import shutil

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import world

STAGING = ".partial"  # OUT.partial: an export being written
REPLACED = ".replaced"  # PATH.replaced: what --overwrite moved aside until the new one is complete


def check_fresh(flag: str, path: str, overwrite: bool, what: str) -> None:
    """Before any work: `path` must be new or empty, unless --overwrite (every rank, the same answer)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag}={path}: not a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConfigError(f"{flag}={path}: not empty ({what} writes a fresh directory; --overwrite replaces it "
                          "as a whole)")


@contextlib.contextmanager
def fresh_directory(path: str, staged: bool):
    """Yield where to write `path` (collective; rank 0 moves directories). Staged: into PATH.partial,
    swapped in for `path` once complete. Not staged (an import: the checkpoint's recorded paths
    name `path`): into `path` itself, an old one moved aside to PATH.replaced first. On success
    what was moved aside is removed; on failure what was written is removed and the old one put back."""
    target = path + STAGING if staged else path
    old = path + REPLACED
    main = world.rank() == 0
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


def save_logits(tensor: torch.Tensor, path: str) -> None:
    """torch.save into a temporary file renamed into place: a failed write leaves no partial file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        torch.save(tensor, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
