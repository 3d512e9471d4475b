"""The megatron side of a conversion: the model of a recipe, opened by the run's model-only bring-up
(training/run.py ``Run.for_model``: the model's flags, no training flags), and a checkpoint loaded into it.

    found = find(load, recipe)              the one read of --load: its checkpoints listed, the recipe,
                                            the newest intact checkpoint (checksums verified) and its
                                            common state (the LoRA record)
    with loaded(found, layout, parse=parse) as run:      the model-only run with that checkpoint's weights
    with open_model(recipe, flags, parse=parse) as run:  the model-only run of a recipe (an import fills it)

``parse``: the entry point's argument layer (top-level ``arguments.parse``), which the run parses with
(training/run.py); every public function of the package takes it from its caller.

The run is handed what ``find`` read (checkpoint/reading.py ``first_read``): its parser takes the
recipe from there (moving a moved directory's tokenizer path onto the copy beside it), its load the
listing, the checkpoint, its integrity and its common state; then it reads the weights."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families, hfdir, shards

RECIPE = "recipe.yaml"  # as checkpoint/recipe.py names it (imported there with megatron-core)


def open_model(recipe: str | None, flags: list[str], first_read=None, *, parse):
    """The model-only run of the recipe's model (None: the recipe the --load checkpoint in ``flags``
    records) with these flags (``first_read``: what :func:`find` read of --load, handed to the run).
    Entering it brings the process groups up; leaving it tears them down, and a teardown that fails
    after the conversion's own error does not replace it."""
    from megatron_ext.training import Run

    return Run.for_model([*(["--recipe", recipe] if recipe else []), *flags], first_read=first_read, parse=parse)


@dataclasses.dataclass(frozen=True)
class Found:
    """What a conversion reads of --load, once, before its run (:func:`find`), and hands to it."""

    load: str
    read: object  # checkpoint/dirs.py FirstRead: the listing, recipe, checkpoint and common state

    @property
    def recipe(self) -> str:
        """The recipe the load reads: --recipe, else the checkpoint's (or an import's beside it)."""
        return self.read.recipe

    @property
    def given(self) -> bool:
        """--recipe was given; else the run's parser takes the recorded one from ``read``."""
        return not self.read.recorded

    @property
    def lora(self) -> dict | None:
        """The newest intact checkpoint's LoRA record: an adapter checkpoint's configuration."""
        return self.read.common.get("lora") if self.read.common is not None else None

    def lora_flags(self) -> list[str]:
        """The LoRA flags an adapter checkpoint was trained with (its base loads first), else []."""
        if self.lora is None:
            return []
        from megatron_ext.checkpoint import lora_flags as recorded_flags  # (megatron-core: after find's platform setup)

        return recorded_flags(self.lora).split()

    def num_layers(self) -> int:
        layers = self.read.recipe_values.get("num_layers", self.read.recipe_values.get("num-layers"))
        if not isinstance(layers, int):
            raise ConfigError(f"--recipe={self.recipe}: no num_layers")
        return layers


def find(load: str, recipe: str | None = None) -> Found:
    """--load read once (checkpoint/reading.py ``first_read``): its committed checkpoints listed, the
    recipe (--recipe, else the newest checkpoint's that has one, else an import's beside them), the
    newest intact checkpoint and its common state, whose LoRA record names the adapters' flags. A
    one-line refusal when there is no recipe."""
    if recipe is not None and not os.path.isfile(recipe):
        raise ConfigError(f"--recipe={recipe}: no such file")
    if recipe is None and not os.path.isdir(load):
        raise ConfigError(f"--load={load}: no such directory")
    from megatron_ext import platform

    platform.setup()  # before megatron-core is imported
    from megatron_ext.checkpoint import first_read

    read = first_read(load, recipe)
    if read.recipe is None:
        raise ConfigError(f"--load={load}: no {RECIPE} there, in its checkpoints or beside them (a checkpoint "
                          "train.py saves records one, an import writes one): pass --recipe")
    return Found(load=load, read=read)


@contextlib.contextmanager
def loaded(found: Found, flags: list[str], *, parse):
    """The model-only run of the checkpoint's recipe with the newest intact checkpoint under
    ``found.load`` loaded, weights only, as --finetune loads them (``run.model``;
    ``run.checkpointer.loaded["iteration"]``: the one loaded). A LoRA adapter checkpoint loads with
    the LoRA flags it records, its base first (checkpoint/lora.py)."""
    with open_model(found.recipe if found.given else None,
                    ["--load", found.load, "--finetune", "--no-load-optim", "--no-load-rng",
                     "--exit-on-missing-checkpoint", *found.lora_flags(), *flags], first_read=found.read,
                    parse=parse) as run:
        from megatron_ext import lora

        model = run.build()
        # the model's own tensors are loaded into in place (shards.py); a LoRA load places a part of
        # the model's keys (the base, then the adapters) through the model itself
        into = None if lora.enabled(run.args) else prebuilt(run.args, model, own_storage=False)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                run.load(weights_only=True, chunks=into)
        except ConfigError as e:  # the damage each checkpoint showed, in the one line
            damage = [line.removeprefix("[checkpoint] ") for line in printed.getvalue().splitlines() if "damaged" in line]
            raise ConfigError("; ".join([str(e), *damage])) from None
        for line in printed.getvalue().splitlines():  # what was loaded instead of a damaged newer checkpoint
            if "damaged" in line or "warning" in line:
                print(line, file=sys.stderr, flush=True)
        yield run


def imported(args) -> bool:
    """The run's model came from an import: its tokenizer directory holds the config.json the import
    copied, of the run's model (a model trained from scratch with the tokenizer of another, whose
    directory holds that model's config.json, is not that model)."""
    import json

    tok_dir = args.tokenizer_model
    path = os.path.join(tok_dir, "config.json") if isinstance(tok_dir, str) else ""
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        raw = json.load(f)
    return (raw.get("num_hidden_layers"), raw.get("hidden_size"), raw.get("vocab_size")) == (
        args.num_layers, args.hidden_size, args.padded_vocab_size)


def hf_config(args, load: str) -> tuple[str, families.Config]:
    """(model type, HF config) of a loaded run: an import's, the config.json it copied into its tokenizer
    directory; a model trained from a recipe, the family that represents its architecture exactly
    (trained.py: else a one-line refusal)."""
    if imported(args):
        return hfdir.read_config(args.tokenizer_model)
    from megatron_ext.hf import trained

    return trained.hf_config(args, load)


def model_tensors(chunk) -> dict[str, torch.Tensor]:
    """Parameter and persistent-buffer tensors of one model chunk by state-dict name."""
    from megatron_ext.seams import unwrapped

    return {k: v for k, v in unwrapped(chunk).state_dict(keep_vars=True).items()
            if "_extra_state" not in k and isinstance(v, torch.Tensor)}


def pieces(args, model) -> list:
    """This rank's part of every megatron tensor of the model (shards.py), as a save describes it."""
    from megatron_ext.checkpoint import sharding_metadata

    return shards.pieces(model, sharding_metadata(args))


def prebuilt(args, model, own_storage: bool) -> list:
    """What stands for the model's chunks in a save or load whose sharded tensors are the model's own
    (shards.Prebuilt): a load reads into the parameters in place, an import's save writes them."""
    from megatron_ext.checkpoint import sharding_metadata

    return [shards.Prebuilt(c, sharding_metadata(args), own_storage=own_storage) for c in model]
