"""Seams of the Megatron-LM flag layer (training/tokenizer.py, the megatron.training pieces the loop
calls): a tokenizer look-up that would need the network, and megatron.training's globals."""
from __future__ import annotations

import os

from megatron_ext.patching import Patch, set_attr

# ---------------------------------------------------------------------------------------------
# tokenizer (training/tokenizer.py)
#
# megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py:97-100 maps GPT2BPETokenizer /
# BertWordPiece* to the hub names 'gpt2' / 'bert-large-(un)cased' and huggingface_tokenizer.py:83
# (and :76) calls AutoTokenizer.from_pretrained(hub name, vocab_file=..., merges_file=...): the hub
# is asked only which tokenizer class that name uses, while the vocabulary comes from the local
# --vocab-file / --merge-file. Without a network that look-up fails, so for those hub names with
# local files we build that class (GPT2's byte-level BPE, BERT's WordPiece) from the files directly.
# Everything else (HuggingFaceTokenizer --tokenizer-model DIR, ...) goes to AutoTokenizer unchanged.
# A scoped record: applied only while megatron builds the tokenizer (training/tokenizer.py build).
# ---------------------------------------------------------------------------------------------
_HUB_NAME_CLASSES = {  # hub name -> (transformers class, its file names, extra kwargs)
    "gpt2": ("GPT2TokenizerFast", ("vocab.json", "merges.txt"), {}),
    "bert-large-uncased": ("BertTokenizerFast", ("vocab.txt",), {"do_lower_case": True}),
    "bert-large-cased": ("BertTokenizerFast", ("vocab.txt",), {"do_lower_case": False}),
}


class _LocalFilesAutoTokenizer:
    """transformers.AutoTokenizer (``wrapped``) with the hub names above built from local files."""

    def __init__(self, wrapped):
        self.wrapped = wrapped

    def from_pretrained(self, pretrained_model_name_or_path, *args, vocab_file=None, merges_file=None, **kwargs):
        spec = _HUB_NAME_CLASSES.get(pretrained_model_name_or_path)
        files = [f for f in (vocab_file, merges_file) if f]
        if spec is None or not vocab_file or not all(os.path.isfile(f) for f in files):
            extra = {k: v for k, v in (("vocab_file", vocab_file), ("merges_file", merges_file)) if v}
            return self.wrapped.from_pretrained(pretrained_model_name_or_path, *args, **extra, **kwargs)
        import tempfile

        import transformers

        class_name, names, extra = spec
        with tempfile.TemporaryDirectory() as tmp:  # the class loads its standard file names from a folder
            for name, path in zip(names, files):
                os.symlink(os.path.abspath(path), os.path.join(tmp, name))
            kwargs.pop("trust_remote_code", None)
            return getattr(transformers, class_name).from_pretrained(tmp, **extra, **kwargs)


def _install_local_files_tokenizer():
    from megatron.core.tokenizers.text.libraries import huggingface_tokenizer as hf

    current = getattr(hf, "AutoTokenizer", None)
    if current is None:
        return lambda: None  # transformers not installed: the tokenizer flags that need it are refused by name
    return set_attr(hf, "AutoTokenizer", _LocalFilesAutoTokenizer(current))


LOCAL_FILES_TOKENIZER = Patch(
    "megatron_training.local_files_tokenizer",
    ["megatron/core/tokenizers/text/libraries/megatron_hf_tokenizer.py:97",
     "megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py:76",
     "megatron/core/tokenizers/text/libraries/huggingface_tokenizer.py:83"],
    "GPT2BPETokenizer / BertWordPiece* with local --vocab-file/--merge-file ask the hub for the class of "
    "'gpt2' / 'bert-large-*' (no network: the build fails)",
    _install_local_files_tokenizer,
)
SEAMS = [LOCAL_FILES_TOKENIZER]


# ---------------------------------------------------------------------------------------------
# megatron.training's globals (training/)
#
# The megatron.training pieces the loop uses (get_optimizer_param_scheduler, training.py:1906;
# update_train_iters, :1528; evaluate, :4160; build_pretraining_data_loader,
# datasets/data_samplers.py:19) read their arguments and timers from megatron/training/
# global_vars.py (_GLOBAL_ARGS :20, _GLOBAL_TIMERS :26). They are set for the length of a run (or
# one call) and restored after, so persistent workers do not carry one run's arguments into the next.
# ---------------------------------------------------------------------------------------------
# evaluate_and_print_results (:4342) also writes to the TensorBoard writer of global_vars.py:22.
class megatron_training_globals:
    def __init__(self, args, tensorboard_writer=None):
        self.args, self.writer = args, tensorboard_writer

    def __enter__(self):
        from megatron.core.timers import Timers
        from megatron.training import global_vars as gv

        self.saved = gv._GLOBAL_ARGS, gv._GLOBAL_TIMERS, gv._GLOBAL_TENSORBOARD_WRITER
        gv._GLOBAL_ARGS = self.args
        gv._GLOBAL_TIMERS = gv._GLOBAL_TIMERS or Timers(
            getattr(self.args, "timing_log_level", 0), getattr(self.args, "timing_log_option", "minmax")
        )
        gv._GLOBAL_TENSORBOARD_WRITER = self.writer
        return self.args

    def __exit__(self, *exc):
        from megatron.training import global_vars as gv

        gv._GLOBAL_ARGS, gv._GLOBAL_TIMERS, gv._GLOBAL_TENSORBOARD_WRITER = self.saved
        return False
