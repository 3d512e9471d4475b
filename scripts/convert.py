"""Hugging Face in and out.

    python scripts/convert.py import --hf HF_DIR [--peft ADAPTER_DIR] --save CKPT
    python scripts/convert.py export --load CKPT (--hf OUT_DIR | --peft OUT_DIR) [--recipe CKPT/recipe.yaml] [--max-shard-size 5GB]
    torchrun --nproc-per-node N scripts/convert.py logits --load CKPT --input-ids 3,17,...[;5,9,...] --out FILE.pt [layout flags]

(a LoRA run exports merged with --hf, its adapters with --peft; docs/finetune.md)

then: torchrun ... train.py --recipe CKPT/recipe.yaml --load CKPT --finetune [layout, data, features]
(docs/hf.md). A refusal is one line, `error: ...`, exit status 1.
"""
from __future__ import annotations

import argparse



def _size(text: str) -> int:
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "B": 1}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> megatron checkpoint + recipe.yaml")
    imp.add_argument("--hf", required=True)
    imp.add_argument("--save", required=True)
    imp.add_argument("--peft", default=None, help="a peft LoRA adapter of the --hf model: imported with it (docs/finetune.md)")
    exp = sub.add_parser("export", help="megatron checkpoint (any layout) -> HF directory")
    exp.add_argument("--load", required=True)
    out = exp.add_mutually_exclusive_group(required=True)
    out.add_argument("--hf", help="the model (a LoRA run's adapters merged into its base)")
    out.add_argument("--peft", help="a LoRA run's adapters, in peft's format")
    exp.add_argument("--recipe", default=None, help="default: LOAD/recipe.yaml")
    exp.add_argument("--max-shard-size", default="5GB", type=_size)
    lg = sub.add_parser("logits", help="fp32 logits [seq, vocab] of the forward on --input-ids (layout flags follow)")
    lg.add_argument("--load", required=True)
    lg.add_argument("--input-ids", required=True, help="token ids; several sequences separated by ';' run packed "
                    "in one forward, each attending only to itself")
    lg.add_argument("--out", required=True)
    lg.add_argument("--recipe", default=None, help="default: LOAD/recipe.yaml")
    return p


def main(argv: list[str] | None = None):
    args, rest = parser().parse_known_args(argv)
    from megatron_ext.errors import ConfigError
    from megatron_ext import hf

    if args.command != "logits" and rest:
        raise ConfigError(f"{args.command}: unknown arguments {' '.join(rest)}")
    if args.command == "import" and args.peft:
        recipe = hf.import_peft(args.hf, args.peft, args.save)
        print(f"imported {args.hf} with the adapter {args.peft} -> {args.save} (recipe {recipe})")
    elif args.command == "import":
        recipe = hf.import_hf(args.hf, args.save)
        print(f"imported {args.hf} -> {args.save} (recipe {recipe})")
    elif args.command == "export" and args.peft:
        keys = hf.export_peft(args.load, args.peft, recipe=args.recipe)
        print(f"exported the adapters of {args.load} -> {args.peft} ({len(keys)} tensors)")
    elif args.command == "export":
        names = hf.export_hf(args.load, args.hf, recipe=args.recipe, max_shard_bytes=args.max_shard_size)
        print(f"exported {args.load} -> {args.hf} ({len(names)} shard{'s' if len(names) != 1 else ''})")
    else:
        import torch

        from megatron_ext.hf import packed

        out = hf.logits(args.load, packed.parse_ids(args.input_ids), recipe=args.recipe, extra=rest)
        if out is not None:
            torch.save(out, args.out)


def _explain(exc: BaseException) -> str | None:
    from megatron_ext.errors import ConfigError

    if isinstance(exc, ConfigError):
        return str(exc)
    from megatron_ext import arguments  # megatron's own refusals of a flag (logits' layout flags)

    return arguments.explain(exc)


if __name__ == "__main__":
    from megatron_ext import errors

    errors.run(main, explain=_explain)
