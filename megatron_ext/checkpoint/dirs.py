"""Checkpoint directories under --save / --load, and their retention (megatron's names):

    iter_0000020/                      committed checkpoint (dist_checkpointing or fsdp_dtensor)
    iter_0000030.partial/              a save in progress, or one a crash interrupted: never loaded
    iter_0000010.deleting/             a checkpoint retention (or a re-save) is deleting
    latest_checkpointed_iteration.txt  newest committed iteration, for people and tools

Only `iter_N` directories are ever loaded. What a killed save or delete leaves behind (`.partial`,
`.deleting`) is removed by the next run that resumes from the same directory
(:func:`remove_interrupted`) or after the next committed save (:func:`debris`).
:func:`check_loadable` is the cheap look (structure and metadata, no checksum pass) that --dry-run
and argument validation take at --load. Nothing here is collective.

A stage that reads --load before the run does (a conversion: checkpointing.first_read) hands what
it found on as a :class:`FirstRead` (``args.first_read``, set by the parse it is handed to); the
later stages of that run take it from there (:func:`handed`) instead of reading the directory again."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil

from megatron_ext.checkpoint import integrity as ckpt_integrity
from megatron_ext.checkpoint.integrity import CONFIG
from megatron_ext.checkpoint.options import CheckpointOptions
from megatron_ext.errors import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
PARTIAL = ".partial"
DELETING = ".deleting"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_PARTIAL_DIR = re.compile(r"^iter_(\d{7})" + re.escape(PARTIAL) + "$")


@dataclasses.dataclass
class FirstRead:
    """--load as the first stage that read it found it (checkpointing.first_read), for the stages after it:
    the recorded recipe (the parser), the cheap look (:func:`check_loadable`), the listing, the checkpoint
    to load, its integrity and its common state (the load)."""

    root: str  # --load, absolute
    iterations: list[int]  # the one listing: its committed iterations, ascending
    tracker_note: str | None  # what is wrong with the tracker file (read_tracker), or None
    recipe: str | None  # the recipe the run reads (--recipe, else the one the checkpoints record), or None
    recorded: bool  # that recipe is the one the checkpoints record (not --recipe)
    recipe_values: dict | None  # as read (config.recipes.read): a mapping of recipe keys to values
    looked: dict  # iteration -> ckpt_integrity.Verifier: each looked at, newest first, down to the intact one
    iteration: int | None  # the newest intact checkpoint (its look, and its common state's read, clean)
    common: dict | None  # that checkpoint's common state (dist_checkpointing), read verified

    def covers(self, load: str | None, ckpt_step: int | None) -> bool:
        """Whether this is what a run of --load ``load`` (and --ckpt-step) reads: the same directory, the
        newest intact checkpoint."""
        return bool(load) and ckpt_step is None and os.path.abspath(load) == self.root


def handed(args) -> FirstRead | None:
    """The FirstRead handed to this run (``args.first_read``) if it is of this run's --load; else None
    (a run that reads --load itself, or a load of another directory: a LoRA adapter's base)."""
    found = getattr(args, "first_read", None)
    return found if found is not None and found.covers(args.load, args.ckpt_step) else None


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def committed_iterations(root: str | None) -> list[int]:
    """Iterations with an `iter_N` directory under `root`, ascending: saves that were committed
    (renamed from `.partial`), intact or not. Partial saves are not listed."""
    if not root or not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m)


def complete_iterations(root: str | None) -> list[int]:
    """Committed iterations whose directory holds the dist_checkpointing metadata.json."""
    return [i for i in committed_iterations(root) if os.path.isfile(os.path.join(checkpoint_dir(root, i), CONFIG))]


def listing(root: str) -> tuple[list[int], str | None]:
    """(the committed iterations, what is wrong with the tracker file or None): --load's one listing."""
    iterations = committed_iterations(root)
    return iterations, read_tracker(root, iterations) if os.path.isdir(root) else None


def read_tracker(root: str, iterations: list[int]) -> str | None:
    """What is wrong with `latest_checkpointed_iteration.txt`, or None. It is only a pointer for
    people and tools (resume lists the directories): damaged if it is not an iteration number or
    names no committed checkpoint. Older than the newest is the crash window between the rename
    and its rewrite, not damage."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(64)
    text = raw.decode("utf-8", "replace").strip()
    if not text.isdigit():
        return f"{TRACKER} is damaged (reads {raw[:32]!r})"
    if int(text) not in iterations:
        return f"{TRACKER} is damaged (names iteration {int(text)}, which has no checkpoint)"
    return None


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_dir(path: str) -> None:
    """Rename first, so a crash half-way through deleting never leaves a half-deleted `iter_N`."""
    doomed = f"{path}{DELETING}"
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def retained(iterations: list[int], keep_last: int | None, retain_interval: int | None) -> set[int]:
    """Which complete checkpoints retention keeps: the newest `keep_last` (--save-keep-last), plus
    every multiple of --save-retain-interval (megatron's flag: with it alone, the newest one and the
    multiples are kept). Neither flag: keep everything."""
    if keep_last is None and retain_interval is None:
        return set(iterations)
    keep = set(iterations[-(keep_last or 1):])
    if retain_interval:
        keep |= {i for i in iterations if i % retain_interval == 0}
    return keep


def debris(names: list[str], newest: int) -> list[str]:
    """What interrupted saves and deletes left behind, once `newest` is committed: `*.deleting`,
    and the `.partial` saves of older iterations. Async saves commit in order, so an older partial
    save is dead; a newer one is a save still being written (--async-save with saves closer together
    than a write takes) and stays."""
    out = []
    for name in names:
        m = _PARTIAL_DIR.match(name)
        if name.endswith(DELETING) or (m and int(m.group(1)) < newest):
            out.append(name)
    return out


def interrupted(root: str) -> list[str]:
    """Every `.partial` save and `.deleting` directory under `root`: before this run has saved
    anything, none of them is being written, so all are what a killed run left behind."""
    if not os.path.isdir(root):
        return []
    return sorted(n for n in os.listdir(root) if _PARTIAL_DIR.match(n) or n.endswith(DELETING))


def remove_interrupted(root: str) -> list[str]:
    """Remove what :func:`interrupted` lists; returns the names removed. Called on rank 0 by a run
    that resumes from its own --save directory, before its first save."""
    names = interrupted(root)
    for name in names:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return names


def _refuse_without_checkpoint(args) -> None:
    """--load naming no checkpoint (an empty or missing directory, a mistyped path) starts training
    from fresh weights in megatron unless --exit-on-missing-checkpoint; here it is refused unless
    asked for: --allow-missing-checkpoint, or --load equal to --save (a job's first run)."""
    root = args.load
    if not root:
        return
    first_run = bool(args.save) and os.path.abspath(root) == os.path.abspath(args.save) and not args.finetune
    allowed = CheckpointOptions.from_args(args).allow_missing_checkpoint
    if args.exit_on_missing_checkpoint:
        if allowed:
            raise ConfigError("--exit-on-missing-checkpoint, --allow-missing-checkpoint: choose one")
        raise ConfigError(f"--load={root}: no checkpoint there (--exit-on-missing-checkpoint)")
    if allowed or first_run:
        return
    what = "--finetune --load" if args.finetune else "--load"
    where = "no such directory" if not os.path.exists(root) else "no checkpoint there (no iter_N directory)"
    raise ConfigError(f"{what}={root}: {where}; name a checkpoint directory, or pass "
                      "--allow-missing-checkpoint to start from fresh weights")


def check_loadable(args) -> None:
    """The cheap look at --load: when it holds committed checkpoints and a look at structure and
    metadata (ckpt_integrity.structure_problems: metadata.json and its own CRC, every file present
    at its recorded size; no checksum pass over the data) finds every one of them damaged, raise
    ConfigError naming the directory and what is wrong with each, as the run itself would stop
    ("every checkpoint is damaged") after reading them. Checkpoints that pass can still fail the
    load's full verification, which then falls back or stops as usual."""
    root = args.load
    first = handed(args)  # what --load's first reader found: it looked at each down to the intact one
    iterations = first.iterations if first else committed_iterations(root)
    if not iterations:
        _refuse_without_checkpoint(args)
        return
    if first and first.iteration is not None:
        return  # an intact one: its structure passed
    found = {}
    for iteration in iterations:
        problems = (first.looked[iteration].structure if first else
                    ckpt_integrity.structure_problems(checkpoint_dir(root, iteration)))
        if not problems:
            return
        found[iteration] = problems
    more = lambda ps: "; ".join(ps[:2]) + (f"; +{len(ps) - 2} more" if len(ps) > 2 else "")  # noqa: E731
    each = ", ".join(f"iter_{i:07d}: {more(ps)}" for i, ps in sorted(found.items(), reverse=True))
    raise ConfigError(f"--load={root}: every checkpoint is damaged ({each})")
