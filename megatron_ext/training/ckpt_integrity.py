"""Checkpoint integrity: a CRC-32 of every file of a checkpoint, taken from the bytes as they are
written and checked before a load reads them.

Save. megatron-core's writer (filesystem_async._write_item, a seam:
megatron_ext/seams/checkpointing.py CHECKSUMMED_WRITES) writes each item of a shard file through a stream that folds every byte into
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

import functools
import inspect
import json
import os
import pickle
import re
import threading
import time
import zlib

import torch

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
class _Sum:
    __slots__ = ("size", "crc", "whole", "seconds")

    def __init__(self):
        self.size, self.crc, self.whole, self.seconds = 0, 0, True, 0.0


_lock = threading.Lock()
_sums: dict[str, _Sum] = {}  # absolute path -> running sum, in the process that writes
_open: dict[int, tuple] = {}  # id(file object) -> (file object, its _Sum): one path lookup per file


def _sum_for(raw) -> _Sum:
    entry = _open.get(id(raw))
    if entry is not None and entry[0] is raw:
        return entry[1]
    with _lock:
        total = _sums.setdefault(os.path.abspath(raw.name), _Sum())
        _open[id(raw)] = (raw, total)
    return total


def start_recording() -> None:
    with _lock:
        _sums.clear()
        _open.clear()


def recorded(directory: str) -> dict:
    """{file name: [size, crc32, whole]} of the files written under `directory` since
    start_recording(); `whole` is False where some bytes did not pass through the sum. Also the
    seconds the sums took under the key None."""
    directory = os.path.abspath(directory)
    with _lock:
        mine = {p: s for p, s in _sums.items() if os.path.dirname(p) == directory}
    out = {os.path.basename(p): [s.size, s.crc, s.whole] for p, s in mine.items()}
    out[None] = sum(s.seconds for s in mine.values())
    return out


class _SummingStream:
    """The file stream megatron-core's writer hands to torch's _write_item (one per item), folding
    every byte written into the file's CRC-32. torch.save makes dozens of small writes per tensor
    (zip records), so small writes are gathered and summed and written together (fewer calls than
    without the sum); large ones go straight through. Drained when the item is written."""

    __slots__ = ("_raw", "_total", "_pending")
    SMALL = 1 << 16

    def __init__(self, raw, total: _Sum):
        self._raw, self._total, self._pending = raw, total, bytearray()

    def write(self, data):
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        if size < self.SMALL:
            self._pending += data
            return size
        self.drain()
        self._sum_and_write(data, size)
        return size

    def drain(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._sum_and_write(pending, len(pending))

    def _sum_and_write(self, data, size: int) -> None:
        total = self._total
        t0 = _clock()
        total.crc = zlib.crc32(data, total.crc)
        total.seconds += _clock() - t0
        if self._raw.write(data) != size:  # a short raw write: the sum is not the file's any more
            total.whole = False
        total.size += size

    def tell(self) -> int:
        return self._raw.tell() + len(self._pending)

    def flush(self) -> None:
        self.drain()
        self._raw.flush()

    def __getattr__(self, name):
        return getattr(self._raw, name)


_clock = time.perf_counter


def summing_write_item(original):
    """Wrap torch's `_write_item(transforms, stream, data, write_item, storage_key, ...)` as
    megatron-core calls it (filesystem_async.py:404-418, positionally) so the file's bytes pass
    through a sum."""
    position = list(inspect.signature(original).parameters).index("stream")

    @functools.wraps(original)  # megatron-core inspects the signature (filesystem_async.py:394)
    def write_item(*args, **kwargs):
        positional = len(args) > position
        raw = args[position] if positional else kwargs["stream"]
        total = _sum_for(raw)
        if raw.tell() != total.size:  # bytes written around us: the sum would not be the file's
            total.whole = False
        stream = _SummingStream(raw, total)
        if positional:
            args = (*args[:position], stream, *args[position + 1:])
        else:
            kwargs["stream"] = stream
        result = original(*args, **kwargs)
        stream.drain()
        return result

    return write_item


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
    from the reader seam for the files each read touches (collective per read)."""

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)
        self.files: dict | None = None  # name -> [size, crc32]; None: no checksums (older checkpoint)
        self.config: dict | None = None  # the checkpoint's metadata.json, as inspect() read it
        self.verified: set = set()
        self.problems: list[str] = []
        self.seconds = 0.0  # this rank's own work (reading and summing)
        self.agree_seconds = 0.0  # the collectives deciding together
        self.bytes_read = 0

    def _size_problem(self, name: str) -> str | None:
        """The listed file is missing or not of its recorded size."""
        size = self.files[name][0]
        path = os.path.join(self.directory, name)
        if not os.path.exists(path):
            return f"{name} missing"
        have = os.path.getsize(path)
        if have != size:
            return f"{name} {'truncated' if have < size else 'longer than written'} ({have} of {size} bytes)"
        return None

    def _check(self, name: str) -> str | None:
        problem = self._size_problem(name)
        if problem:
            return problem
        size, crc = self.files[name]
        got_size, got_crc = crc32_file(os.path.join(self.directory, name))
        self.bytes_read += got_size
        if got_size != size or got_crc != crc:
            return f"{name} checksum mismatch"
        return None

    def inspect(self) -> tuple[list[str], bool]:
        """(problems, verifiable), the same on every rank."""
        t0 = time.perf_counter()
        problems = []
        config_path = os.path.join(self.directory, CONFIG)
        config = None
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
                files = {str(k): [int(v[0]), int(v[1])] for k, v in entry["files"].items()}
            except (AttributeError, KeyError, TypeError, ValueError, IndexError):
                ok, files = False, None
            if not ok:
                problems.append(f"{CONFIG} checksum mismatch")
            else:
                self.files = files
                if DCP_METADATA not in files:
                    problems.append(f"{DCP_METADATA} not listed in {CONFIG}")
        if self.files is not None:
            if DCP_METADATA in self.files:  # every rank reads it
                problem = self._check(DCP_METADATA)
                self.verified.add(DCP_METADATA)
                if problem:
                    problems.append(problem)
            if torch.distributed.get_rank() == 0:  # the set is complete, each file whole
                problems += [p for p in map(self._size_problem, sorted(self.files)) if p]
        elif config is not None and torch.distributed.get_rank() == 0:
            problems += self._structure_only()
        t1 = time.perf_counter()
        self.config = config
        self.problems, wait = _agree(problems)
        self.seconds += t1 - t0
        self.agree_seconds += wait
        return self.problems, self.files is not None

    def _structure_only(self) -> list[str]:
        """No checksums: every file `.metadata` names exists and is long enough for its items."""
        path = os.path.join(self.directory, DCP_METADATA)
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
            file = os.path.join(self.directory, name)
            if not os.path.exists(file):
                problems.append(f"{name} missing")
            elif os.path.getsize(file) < end:
                problems.append(f"{name} truncated ({os.path.getsize(file)} of at least {end} bytes)")
        return problems

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
        t1 = time.perf_counter()
        problems, wait = _agree(problems)
        self.seconds += t1 - t0
        self.agree_seconds += wait
        if problems:
            self.problems = problems
            raise Damaged(problems)
