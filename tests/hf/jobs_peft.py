"""Job functions of the peft adapter tests (tests/hf/test_peft_io.py), run on the gloo worker pools of
tests/dist.py. Logits go back as numpy arrays (a pickled tensor is shared through a file descriptor
whose server thread would outlive the job)."""
from __future__ import annotations

import os

import arguments


def adapter_story(hf_dir: str, peft_dir: str, root: str, sequences: list, train: list) -> dict:
    """One process, one model: the adapter imported with its base; the packed logits of base +
    adapter; the untouched adapter exported again; a few LoRA iterations (``train``: the LoRA flags
    and where they start: from the import itself, or its base) saved, exported as a peft adapter and
    merged, and the trained run's packed logits; the refusal of a --peft export without adapters."""
    from megatron_ext import hf
    from megatron_ext.errors import ConfigError
    from megatron_ext.training.run import Run

    ckpt, run = os.path.join(root, "ckpt"), os.path.join(root, "run")
    out = {"recipe": hf.import_peft(hf_dir, peft_dir, ckpt, parse=arguments.parse)}
    out["imported"] = hf.logits(ckpt, sequences, parse=arguments.parse).numpy()
    out["roundtrip"] = hf.export_peft(ckpt, os.path.join(root, "roundtrip"), parse=arguments.parse)
    start, flags = train
    recipe = os.path.join(start, "recipe.yaml")
    argv = ["--recipe", recipe, "--load", start, "--finetune", "--mock-data", "--num-workers", "0", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-2",
            "--lr-warmup-iters", "0", "--save", run, "--save-interval", "3", "--log-interval", "1", "--world-size", "1",
            *flags]
    with Run.from_argv(argv, parse=arguments.parse) as r:
        out["losses"] = [h["lm loss"] for h in r.train()]
    # the run's checkpoint records its recipe, LoRA flags and tokenizer: no --recipe
    out["exported"] = hf.export_peft(run, os.path.join(root, "trained"), parse=arguments.parse)
    hf.export_hf(run, os.path.join(root, "merged"), parse=arguments.parse)
    out["trained"] = hf.logits(run, sequences, parse=arguments.parse).numpy()
    try:
        hf.export_peft(os.path.join(ckpt, "base"), os.path.join(root, "nothing"), parse=arguments.parse)
    except ConfigError as e:
        out["no_adapters"] = str(e)
    return out


def logits_under(load: str, sequences: list, layouts: dict) -> dict:
    """The packed logits under each layout (every rank calls): {name: rank 0's logits}."""
    from megatron_ext import hf

    out = {}
    for name, flags in layouts.items():
        got = hf.logits(load, sequences, extra=list(flags), parse=arguments.parse)
        out[name] = None if got is None else got.numpy()
    return out
