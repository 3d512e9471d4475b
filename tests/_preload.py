"""Imported once by the worker pools' fork server (tests/dist.py): every worker forked from it
starts with torch, megatron-core and the entry points already imported."""
from megatron_ext import platform

platform.setup()

import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import megatron.training.training  # noqa: E402,F401

import arguments  # noqa: E402,F401  (every job parses with it)
import train  # noqa: E402,F401
import megatron_ext.training.data  # noqa: E402,F401  (megatron's tokenizer package imports transformers when installed)
import megatron.core.tokenizers.text.libraries.huggingface_tokenizer as _hf  # noqa: E402  (imports transformers)
import megatron_ext.checkpoint.checkpointer  # noqa: E402,F401
import megatron_ext.planner.trace  # noqa: E402,F401
import megatron_ext.schedules.overlap_1f1b  # noqa: E402,F401

_hf.AutoTokenizer  # noqa: B018  (transformers resolves its tokenizer classes on first use)
