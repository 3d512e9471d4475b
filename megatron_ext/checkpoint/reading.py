"""--load read once, before any process group exists (``first_read``): what a stage that reads it ahead of
its run hands to the run's parse."""
from __future__ import annotations

import contextlib
import os

from megatron.core import dist_checkpointing

from megatron_ext import seams
from megatron_ext.checkpoint import dirs as ckpt_dirs
from megatron_ext.checkpoint import integrity
from megatron_ext.checkpoint import recipe as ckpt_recipe


def first_read(load: str, recipe: str | None = None) -> ckpt_dirs.FirstRead:
    """--load read once, before any process group exists, by a stage that reads it ahead of its run (a
    conversion, which needs the recipe's layers and the LoRA record before it can name its run's flags):
    the one listing of its checkpoints and the tracker; the recipe (``recipe``, else the one the
    checkpoints record: ckpt_recipe.recorded); then, newest first, each checkpoint looked at as the load
    looks (ckpt_integrity.Verifier.inspect, without a world: metadata.json, `.metadata`'s checksum, every file's size) and
    its common state read with the files that read touches verified, down to the first that is intact.
    Handed to the run's parse (``Run.for_model(argv, first_read=...)``), so that neither its parser, its
    checks nor its load read any of it again (ckpt_dirs.handed); the load agrees over the ranks on what
    each found, and says what it skips and refuses as it does when it looks itself. Nothing collective."""
    from megatron_ext.config import recipes

    root = os.path.abspath(load)
    iterations, note = ckpt_dirs.listing(root)
    path = recipe if recipe is not None else ckpt_recipe.recorded(root, iterations=iterations)
    looked, intact, common = {}, None, None
    for iteration in iterations[::-1]:
        verifier = looked[iteration] = integrity.Verifier(ckpt_dirs.checkpoint_dir(root, iteration), collective=False)
        if verifier.inspect()[0]:
            continue
        if (verifier.config or {}).get("sharded_backend") == "torch_dist":  # fsdp_dtensor: its load reads its own
            try:
                with seams.verified_reads(verifier) if verifier.files is not None else contextlib.nullcontext():
                    common = dist_checkpointing.load_common_state_dict(verifier.directory)
            except BaseException:  # torch's CheckpointException (wrapping ours) is a BaseException
                if not verifier.problems:  # set when a file the read touched failed its checksum
                    raise
                continue
        intact = iteration
        break
    return ckpt_dirs.FirstRead(root=root, iterations=iterations, tracker_note=note, recipe=path,
                               recorded=recipe is None and path is not None,
                               recipe_values=recipes.read(path) if path else None,
                               looked=looked, iteration=intact, common=common)
