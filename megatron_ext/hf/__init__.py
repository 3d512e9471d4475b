"""Hugging Face in and out: ``import_hf`` (HF directory -> megatron checkpoint + recipe),
``export_hf`` (checkpoint of any layout -> HF directory), ``logits`` (the model's forward on ids) and
``save_logits`` (their file, written whole or not at all).
The weight mapping is one table per family in ``families.py``; the CLI is scripts/convert.py."""
from megatron_ext.hf.convert import export_hf, import_hf, logits, save_logits

__all__ = ["import_hf", "export_hf", "logits", "save_logits"]
