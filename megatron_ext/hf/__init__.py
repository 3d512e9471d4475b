"""Hugging Face in and out: ``import_hf`` (HF directory -> megatron checkpoint + recipe),
``export_hf`` (checkpoint of any layout -> HF directory; a LoRA run's merged), ``logits`` (the model's
forward on ids, several sequences packed into one) and ``save_logits`` (their file, written whole or
not at all), ``import_peft`` / ``export_peft`` (LoRA adapters in and out of peft's format). The weight
mapping is one table per family in ``weight_tables.py``; the CLI is scripts/convert.py. Each but
``save_logits`` opens a run and takes the entry point's argument layer, ``parse=arguments.parse``.

    importer.py  exporter.py  peft.py  packed.py      import, export, adapters, logits
    checkpoint.py   the megatron side: the run's model-only bring-up of a recipe, --load read once and loaded
    hfdir.py        the Hugging Face side: a model directory read (config, shards' headers, tokenizer)
    families.py     the flags a family's config.json implies (config_json.py: the config as read)
    weight_tables.py   one weight table per family, as data
    table.py        a family's table (weight_tables.py) filled in for one model, and its transforms
    shards.py       which part of each tensor a rank holds, and the HF reads that fill it
    outputs.py      what a conversion writes, never partial (fresh directories, a file renamed into place)
    world.py        the conversion's processes: this rank, refusals every rank agrees on, progress
"""
from megatron_ext.hf.exporter import export_hf
from megatron_ext.hf.importer import import_hf
from megatron_ext.hf.outputs import save_logits
from megatron_ext.hf.packed import logits
from megatron_ext.hf.peft import export_peft, import_peft

__all__ = ["import_hf", "export_hf", "logits", "save_logits", "import_peft", "export_peft"]
