"""Hugging Face in and out.

    [torchrun --nproc-per-node N] scripts/convert.py import --hf HF_DIR --save CKPT [--overwrite] [layout flags]
    python scripts/convert.py import --hf HF_DIR --peft ADAPTER_DIR --save CKPT
    [torchrun --nproc-per-node N] scripts/convert.py export --load CKPT --hf OUT_DIR [--overwrite]
                                                     [--recipe RECIPE] [--max-shard-size 5GB]
    python scripts/convert.py export --load CKPT --peft OUT_DIR [--overwrite] [--recipe RECIPE]
    torchrun --nproc-per-node N scripts/convert.py logits --load CKPT --input-ids 3,17,...[;5,9,...] --out FILE.pt
                                                     [layout flags]

export takes an import (its config.json and tokenizer go back) or a model trained from a recipe: the
Hugging Face family that represents its architecture exactly, with its tokenizer's files (docs/hf.md,
"From a recipe"); an architecture no family represents is refused in one line naming the property.
A LoRA run exports merged with --hf, its adapters alone with --peft (docs/finetune.md); logits of
several sequences (';') run packed into one forward, each attending only to itself.

then: torchrun ... train.py --load CKPT --finetune [layout, data, features] (docs/hf.md). A checkpoint
records its recipe: --recipe only overrides it. Under torchrun, import reads on every rank only the
slices of its shard (layout flags: --tensor-model-parallel-size, --pipeline-model-parallel-size,
--expert-model-parallel-size, ...), export gives every rank a pipeline stage and its shard files.
import and export write a fresh directory (--overwrite replaces an existing one as a whole); a failure
leaves nothing behind. A failure is one line, `error: ...`, exit status 1.
"""
from __future__ import annotations

import argparse
import os


from megatron_ext.errors import TRACEBACK_ENV, ConfigError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other refusal (not usage + exit status 2)
        raise ConfigError(message)


def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def _rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


# ---------------------------------------------------------------------------------------------
# the subcommands: each adds its arguments and runs (`rest`: the megatron flags it passes on)
# ---------------------------------------------------------------------------------------------
def _import_arguments(p) -> None:
    p.add_argument("--hf", required=True, help="a Hugging Face model directory (config.json, safetensors)")
    p.add_argument("--save", required=True, help="the checkpoint directory to write (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace --save if it holds anything")
    p.add_argument("--peft", default=None,
                   help="a peft LoRA adapter of the --hf model, imported with it (one process; docs/finetune.md)")


def _import(args, rest: list[str], parse) -> None:
    from megatron_ext import hf

    if args.peft:
        if rest or args.overwrite or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("import --peft: runs on one process into a new --save, without layout flags or "
                              "--overwrite (train.py reshards the checkpoint onto any layout)")
        recipe = hf.import_peft(args.hf, args.peft, args.save, parse=parse)
        print(f"imported {args.hf} with the adapter {args.peft} -> {args.save} (recipe {recipe})")
        return
    recipe = hf.import_hf(args.hf, args.save, extra=rest, overwrite=args.overwrite, parse=parse)
    if _rank0():
        print(f"imported {args.hf} -> {args.save} (recipe {recipe})")


def _export_arguments(p) -> None:
    p.add_argument("--load", required=True, help="a checkpoint directory (its newest intact checkpoint is exported)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", help="the Hugging Face directory to write (new or empty); a LoRA run's adapters merged "
                     "into its base")
    out.add_argument("--peft", help="a LoRA run's adapters, in peft's format (one process)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --hf (--peft) as a whole if it holds anything (written aside, then swapped in)")
    p.add_argument("--recipe", default=None, help="default: the recipe the checkpoint records")
    p.add_argument("--max-shard-size", default="5GB", type=_size)


def _export(args, rest: list[str], parse) -> None:
    from megatron_ext import hf

    if rest:
        raise ConfigError(f"export: unknown arguments {' '.join(rest)}")
    if args.peft:
        keys = hf.export_peft(args.load, args.peft, recipe=args.recipe, overwrite=args.overwrite, parse=parse)
        print(f"exported the adapters of {args.load} -> {args.peft} ({len(keys)} tensors)")
        return
    replacing = args.overwrite and os.path.isdir(args.hf) and bool(os.listdir(args.hf))
    names, iteration = hf.export_hf(args.load, args.hf, recipe=args.recipe, max_shard_bytes=args.max_shard_size,
                                    overwrite=args.overwrite, parse=parse)
    if _rank0():
        shards = f"{len(names)} shard{'s' if len(names) != 1 else ''}"
        print(f"exported {args.load} (iteration {iteration}) -> {args.hf} ({shards}"
              + ("; its previous contents replaced)" if replacing else ")"))


def _logits_arguments(p) -> None:
    p.add_argument("--load", required=True)
    p.add_argument("--input-ids", required=True, help="token ids; several sequences separated by ';' run packed "
                   "in one forward, each attending only to itself")
    p.add_argument("--out", required=True)
    p.add_argument("--recipe", default=None, help="default: the recipe the checkpoint records")


def _logits(args, rest: list[str], parse) -> None:
    from megatron_ext import hf
    from megatron_ext.hf import packed

    out = hf.logits(args.load, packed.parse_ids(args.input_ids), recipe=args.recipe, extra=rest, parse=parse)
    if out is not None:
        hf.save_logits(out, args.out)


COMMANDS = {  # name: (help, its arguments, what it runs)
    "import": ("HF directory -> megatron checkpoint + recipe.yaml (layout flags follow)", _import_arguments, _import),
    "export": ("megatron checkpoint (any layout) -> HF directory, or a LoRA run's adapters -> peft",
               _export_arguments, _export),
    "logits": ("fp32 logits [seq, vocab] of the forward on --input-ids (layout flags follow)", _logits_arguments,
               _logits),
}


def parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text))
    return p


def main(argv: list[str] | None = None):
    args, rest = parser().parse_known_args(argv)
    parse = _argument_layer()
    try:
        COMMANDS[args.command][2](args, rest, parse)
    except (ConfigError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        raise ConfigError(_explain_unexpected(args.command, e)) from e


def _argument_layer():
    """What the run a conversion opens parses with: the repository's argument layer (arguments.py)."""
    from megatron_ext import platform

    platform.setup()  # before megatron-core is imported (its unguarded triton import)
    import arguments

    return arguments.parse


def _explain_unexpected(command: str, exc: BaseException) -> str:
    """One line for anything else a subcommand raised: megatron's refusal of a flag where it names
    one (the layout flags), else what was raised."""
    from megatron_ext import platform

    platform.setup()  # before megatron-core is imported (its unguarded triton import)
    import arguments

    line = arguments.explain(exc) if isinstance(exc, (AssertionError, ValueError, RuntimeError)) else None
    if line:
        return line
    text = str(exc).strip().splitlines()
    return f"{command}: {type(exc).__name__}: {text[0] if text else ''} ({TRACEBACK_ENV}=1 shows the traceback)"


if __name__ == "__main__":
    from megatron_ext import errors

    errors.quiet()  # third-party warnings that tell the user nothing (MEGATRON_EXT_VERBOSE=1 shows them)
    errors.run(main, explain=lambda e: str(e) if isinstance(e, ConfigError) else None)
