"""Checkpoint integrity: a CRC-32 of every file of a checkpoint, taken from the bytes as they are
written and checked before a load reads them.

Save. megatron-core's writer (filesystem_async._write_item, a seam:
megatron_ext/seams/checkpointing.py CHECKSUMMED_WRITES, which keeps the running sums) writes each item of a shard file through a stream that folds every byte into
the file's running CRC-32 on its way to the file, so nothing is read back. A synchronous save keeps
the sums in this process; the forked writer of --async-save leaves them in a small sidecar file
(`.checksums.<rank>.json`) that its rank picks up and removes at commit. At commit the ranks' sums are
gathered on rank 0, which adds the small files it wrote itself (the `.metadata` of torch's
dist-checkpoint, read back) and records the complete list in the checkpoint's own `metadata.json`
(megatron-core keeps its config there and ignores other keys, core.py:64), before the directory is
renamed into place:

    "checksums": {"algorithm": "crc32", "files": {name: [size, crc32], ...}, "crc32": <of the rest>}

Load. Before any byte is used: every rank checks metadata.json (its own CRC) and `.metadata` (every
rank reads it); rank 0 checks that every listed file exists with its recorded size. Then, while
dist_checkpointing loads, each read of torch's FileSystemReader (a seam: VERIFIED_READS) first
verifies the files that read touches, which are exactly the files this rank reads, and all ranks
agree (all_gather_object) before any of it is read. Checkpoints without a "checksums" entry (saved
before this existed) are checked for completeness only: every file `.metadata` names exists and
holds the bytes it points to."""
from __future__ import annotations

import json
import os
import pickle
import re
import time
import zlib

import torch

from megatron_ext.seams.checkpointing import recorded

ALGORITHM = "crc32"
KEY = "checksums"
CONFIG = "metadata.json"  # megatron-core's CONFIG_FNAME (dist_checkpointing/core.py)
DCP_METADATA = ".metadata"  # torch dist-checkpoint metadata (filesystem.py: _metadata_fn)
SIDECAR = ".checksums.{rank}.json"
_CHUNK = 16 << 20


def crc32_file(path: str) -> tuple[int, int]:
    """(size, crc32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                return size, crc
            crc = zlib.crc32(block, crc)
            size += len(block)


# ---------------------------------------------------------------------------------------------
# save: checksums of the bytes as they are written
# ---------------------------------------------------------------------------------------------
def leave_sums_after(async_fn, directory: str, rank: int):
    """The forked --async-save writer runs `async_fn`; afterwards it leaves its sums beside the
    files for its rank's commit (the sums live in the writer process only)."""

    def write_then_leave_sums(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return async_fn(*args, **kwargs)
        finally:
            sums = recorded(directory)
            seconds = sums.pop(None)
            with open(os.path.join(directory, SIDECAR.format(rank=rank)), "w") as f:
                json.dump({"files": sums, "seconds": seconds, "writer_seconds": time.perf_counter() - t0}, f)

    return write_then_leave_sums


def take_sums(directory: str, rank: int, from_sidecar: bool) -> tuple[dict, float, float | None]:
    """This rank's {file: [size, crc32, whole]}, the seconds the writer spent summing, and (for a
    forked writer) the seconds it ran. This rank's shard files (torch names them
    `__<rank>_<n>.distcp`) that no writer summed, as with megatron-core's persistent worker
    (another process we cannot reach), are read once here."""
    sums, seconds, writer_seconds = {}, 0.0, None
    if not from_sidecar:
        sums = recorded(directory)
        seconds = sums.pop(None)
    else:
        path = os.path.join(directory, SIDECAR.format(rank=rank))
        if os.path.exists(path):  # absent: nothing to write on this rank, or not our writer
            with open(path) as f:
                payload = json.load(f)
            os.remove(path)
            sums, seconds, writer_seconds = payload["files"], payload["seconds"], payload["writer_seconds"]
    own = re.compile(rf"__{rank}_\d+\.distcp$")
    for name in os.listdir(directory):
        if own.search(name) and not (name in sums and sums[name][2]):
            t0 = time.perf_counter()
            sums[name] = [*crc32_file(os.path.join(directory, name)), True]
            seconds += time.perf_counter() - t0
    return sums, seconds, writer_seconds


def _self_crc(config: dict) -> int:
    body = dict(config)
    body[KEY] = {k: v for k, v in config[KEY].items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def write_manifest(directory: str, gathered: list[dict]) -> tuple[int, float]:
    """On rank 0 at commit, when every rank's files and the metadata are written: record every file
    of `directory` with its size and CRC-32 in metadata.json. Files no writer summed (the
    `.metadata`, or a writer that could not sum) are read once here. Returns (files, seconds)."""
    t0 = time.perf_counter()
    sums = {}
    for part in gathered:
        sums.update(part)
    files = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == CONFIG or name.startswith(".checksums.") or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        got = sums.get(name)
        if got is not None and got[2] and got[0] == size:
            files[name] = [size, got[1]]
        else:
            files[name] = list(crc32_file(path))
    config_path = os.path.join(directory, CONFIG)
    with open(config_path) as f:
        config = json.load(f)
    config[KEY] = {"algorithm": ALGORITHM, "files": files}
    config[KEY]["crc32"] = _self_crc(config)
    # rewritten in place as megatron-core wrote it (no fsync): the directory is still `.partial`;
    # should a power loss after the rename cost its contents, the load reports it and falls back
    with open(config_path, "w") as f:
        json.dump(config, f)
    return len(files), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# structure and metadata: what can be told without reading the data files
# ---------------------------------------------------------------------------------------------
def read_config(directory: str) -> tuple[dict | None, dict | None, list[str]]:
    """(metadata.json as read, its checksums {name: [size, crc32]} or None if it records none,
    problems): the file is there, parses, and its own CRC matches."""
    problems = []
    config, files = None, None
    config_path = os.path.join(directory, CONFIG)
    if not os.path.exists(config_path):
        problems.append(f"{CONFIG} missing")
    else:
        try:
            with open(config_path) as f:
                config = json.load(f)
            if not isinstance(config, dict):
                raise ValueError("not a mapping")
        except (ValueError, UnicodeDecodeError) as e:
            problems.append(f"{CONFIG} unreadable ({type(e).__name__})")
            config = None
    if config is not None and KEY in config:
        entry = config[KEY]
        try:
            ok = entry.get("algorithm") == ALGORITHM and entry.get("crc32") == _self_crc(config)
            listed = {str(k): [int(v[0]), int(v[1])] for k, v in entry["files"].items()}
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            ok, listed = False, None
        if not ok:
            problems.append(f"{CONFIG} checksum mismatch")
        else:
            files = listed
            if DCP_METADATA not in files:
                problems.append(f"{DCP_METADATA} not listed in {CONFIG}")
    return config, files, problems


def size_problem(directory: str, name: str, size: int) -> str | None:
    """The listed file is missing or not of its recorded size."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return f"{name} missing"
    have = os.path.getsize(path)
    if have != size:
        return f"{name} {'truncated' if have < size else 'longer than written'} ({have} of {size} bytes)"
    return None


def listed_size_problems(directory: str, files: dict) -> list[str]:
    """Every file metadata.json lists exists with its recorded size."""
    return [p for p in (size_problem(directory, name, files[name][0]) for name in sorted(files)) if p]


def structure_only(directory: str) -> list[str]:
    """No checksums: every file `.metadata` names exists and is long enough for its items."""
    path = os.path.join(directory, DCP_METADATA)
    if not os.path.exists(path):
        return [f"{DCP_METADATA} missing"]
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f)
        ends = {}
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle means unreadable
        return [f"{DCP_METADATA} unreadable ({type(e).__name__})"]
    problems = []
    for name, end in sorted(ends.items()):
        file = os.path.join(directory, name)
        if not os.path.exists(file):
            problems.append(f"{name} missing")
        elif os.path.getsize(file) < end:
            problems.append(f"{name} truncated ({os.path.getsize(file)} of at least {end} bytes)")
    return problems


def structure_problems(directory: str) -> list[str]:
    """What a look at the structure and metadata finds wrong with a checkpoint, on this process
    alone and without reading the data files (no checksum pass): metadata.json and its own CRC,
    every listed file present with its recorded size (or, without checksums, every file `.metadata`
    names long enough). A checkpoint that passes can still fail the full verification of a load."""
    config, files, problems = read_config(directory)
    if files is not None:
        problems += listed_size_problems(directory, files)
    elif config is not None:
        problems += structure_only(directory)
    return problems


# ---------------------------------------------------------------------------------------------
# load: verify before use
# ---------------------------------------------------------------------------------------------
class Damaged(Exception):
    """A checkpoint file failed verification (raised on every rank, after they agreed)."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


def union_over_ranks(items: list[str]) -> list[str]:
    """The sorted union of every rank's items, the same list on every rank (collective)."""
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, sorted(set(items)))
    return sorted({item for part in everyone for item in part})


def _agree(problems: list[str]) -> tuple[list[str], float]:
    """union_over_ranks(problems), and the seconds it took (mostly waiting for the slowest rank)."""
    t0 = time.perf_counter()
    return union_over_ranks(problems), time.perf_counter() - t0


class Verifier:
    """One checkpoint directory: `inspect()` before the load (collective), then `verify_read()`
    from the reader seam for the files each read touches (collective per read).

    Before any process group exists (a conversion's first read of --load, checkpointing.first_read),
    a Verifier made with ``collective=False`` inspects on this process alone (`inspect()`, then its reads
    verified here); the load it is handed to agrees on what it found (`agree()`, collective) instead of
    looking again, and verifies only the files not verified yet."""

    def __init__(self, directory: str, collective: bool = True):
        self.directory = os.path.abspath(directory)
        self.collective = collective
        self.files: dict | None = None  # name -> [size, crc32]; None: no checksums (older checkpoint)
        self.config: dict | None = None  # the checkpoint's metadata.json, as inspect() read it
        self.structure: list[str] = []  # without a world: what inspect() found of the structure alone
        self.verified: set = set()
        self.problems: list[str] = []
        self.seconds = 0.0  # this rank's own work (reading and summing)
        self.agree_seconds = 0.0  # the collectives deciding together
        self.bytes_read = 0

    def _check(self, name: str) -> str | None:
        problem = size_problem(self.directory, name, self.files[name][0])
        if problem:
            return problem
        size, crc = self.files[name]
        got_size, got_crc = crc32_file(os.path.join(self.directory, name))
        self.bytes_read += got_size
        if got_size != size or got_crc != crc:
            return f"{name} checksum mismatch"
        return None

    def _agree(self, problems: list[str]) -> list[str]:
        """The problems every rank found (collective), or this process's own before a world exists."""
        if not self.collective:
            return sorted(set(problems))
        agreed, wait = _agree(problems)
        self.agree_seconds += wait
        return agreed

    def _look(self, sizes: bool) -> list[str]:
        """metadata.json and its own CRC, `.metadata`'s checksum and, with ``sizes``, every listed file
        at its recorded size (without checksums: every file `.metadata` names long enough). Reads no
        data file; nothing collective."""
        t0 = time.perf_counter()
        self.config, self.files, read = read_config(self.directory)
        checked, sized = [], []
        if self.files is not None:
            if DCP_METADATA in self.files:  # every rank reads it
                problem = self._check(DCP_METADATA)
                self.verified.add(DCP_METADATA)
                if problem:
                    checked.append(problem)
            if sizes:
                sized = listed_size_problems(self.directory, self.files)
        elif self.config is not None and sizes:
            sized = structure_only(self.directory)
        self.structure = [*read, *sized] if sizes else []
        self.seconds += time.perf_counter() - t0
        return [*read, *checked, *sized]

    def agree(self) -> tuple[list[str], bool]:
        """inspect()'s answer for a Verifier that inspected before the world existed (and the reads
        verified since): the union of what every rank found (collective); from now on its reads are
        verified together."""
        self.collective = True
        self.problems = self._agree(self.problems)
        return self.problems, self.files is not None

    def inspect(self) -> tuple[list[str], bool]:
        """(problems, verifiable), the same on every rank (collective); with ``collective=False``, before
        any world exists, this process's own, every file's size included, and `structure` set (what
        structure_problems would say): `agree()` later makes them every rank's."""
        sizes = not self.collective or torch.distributed.get_rank() == 0
        self.problems = self._agree(self._look(sizes=sizes))
        return self.problems, self.files is not None

    def verify_read(self, names) -> None:
        """Called by every rank for each read of the load (collective): verify the files this read
        touches that are not verified yet; raise Damaged on every rank if any rank found damage."""
        t0 = time.perf_counter()
        problems = []
        for name in sorted(set(names) - self.verified):
            if name not in self.files:
                problems.append(f"{name} not listed in {CONFIG}")
            else:
                problem = self._check(name)
                if problem:
                    problems.append(problem)
            self.verified.add(name)
        self.seconds += time.perf_counter() - t0
        problems = self._agree(problems)
        if problems:
            self.problems = problems
            raise Damaged(problems)
