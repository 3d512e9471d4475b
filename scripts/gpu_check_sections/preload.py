"""Imported once by the fork server of ``scripts/gpu_check.py`` without CUDA: every section's process
forked from it starts with torch, megatron-core and the sections already imported (about 7 s of CPU
each would otherwise pay). Never used with CUDA, which cannot be initialised in a forked child of a
process that touched it: there each section is a fresh interpreter."""
from megatron_ext import platform

platform.setup()

import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import megatron.training.training  # noqa: E402,F401

import arguments  # noqa: E402,F401
import train  # noqa: E402,F401
import megatron_ext.training.data  # noqa: E402,F401  (megatron's tokenizer package imports transformers when installed)
import gpu_check_sections  # noqa: E402,F401
import megatron.core.tokenizers.text.libraries.huggingface_tokenizer as _hf  # noqa: E402  (imports transformers)
import megatron_ext.checkpoint.checkpointer  # noqa: E402,F401
import megatron_ext.planner.trace  # noqa: E402,F401

_hf.AutoTokenizer  # noqa: B018  (transformers resolves its tokenizer classes on first use)
