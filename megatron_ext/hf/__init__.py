"""Hugging Face in and out: ``import_hf`` (HF directory -> megatron checkpoint + recipe),
``export_hf`` (checkpoint of any layout -> HF directory; a LoRA run's merged), ``logits`` (the model's
forward on ids, several sequences packed into one) and ``save_logits`` (their file, written whole or
not at all), ``import_peft`` / ``export_peft`` (LoRA adapters in and out of peft's format). The weight
mapping is one table per family in ``families.py``; the CLI is scripts/convert.py."""
from megatron_ext.hf.convert import export_hf, import_hf, save_logits
from megatron_ext.hf.packed import logits
from megatron_ext.hf.peft import export_peft, import_peft

__all__ = ["import_hf", "export_hf", "logits", "save_logits", "import_peft", "export_peft"]
