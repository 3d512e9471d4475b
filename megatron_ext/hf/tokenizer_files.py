"""The run's tokenizer as Hugging Face tokenizer files (an export writes them beside the weights), so that
``AutoTokenizer.from_pretrained(OUT)`` gives the ids the run trained on:

    HuggingFaceTokenizer, SFTTokenizer   its directory's files, as they are (no weights; the export then
                                         writes the model's config.json), or a hub id's, saved
    GPT2BPETokenizer                     transformers' GPT2TokenizerFast from --vocab-file and --merge-file
                                         (byte-level BPE, <|endoftext|> its end of document)

Any other kind has no Hugging Face files here: ``write`` returns the one line that says so (the weights
are written all the same). The byte-level NullTokenizer (ids 0..255 are bytes, then end-of-document) has
no Hugging Face tokenizer class."""
from __future__ import annotations

import os
import shutil

from megatron_ext.hf import hfdir

GPT2_EOD = "<|endoftext|>"
MODEL_FILES = ("config.json", "generation_config.json")  # another model's, where its tokenizer was borrowed
_NO_FILES = {
    "NullTokenizer": "ids 0..255 are the text's bytes and --vocab-size - 1 is end-of-document; no Hugging Face "
                     "tokenizer class reads them",
}


def write(args, target: str) -> str | None:
    """The run's tokenizer files into ``target``; None, or the one line saying why none were written."""
    kind = args.tokenizer_type
    if kind in ("HuggingFaceTokenizer", "SFTTokenizer") and os.path.isdir(args.tokenizer_model):
        for name in sorted(os.listdir(args.tokenizer_model)):
            path = os.path.join(args.tokenizer_model, name)
            if os.path.isfile(path) and not name.endswith(hfdir.WEIGHT_FILES) and name not in MODEL_FILES:
                shutil.copy2(path, os.path.join(target, name))
        return None
    if kind in ("HuggingFaceTokenizer", "SFTTokenizer"):  # a hub id: transformers' copy of it, saved
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(args.tokenizer_model).save_pretrained(target)
        return None
    if kind == "GPT2BPETokenizer":
        from transformers import GPT2TokenizerFast

        tokenizer = GPT2TokenizerFast(vocab=args.vocab_file, merges=args.merge_file, unk_token=GPT2_EOD,
                                      bos_token=GPT2_EOD, eos_token=GPT2_EOD)
        tokenizer.save_pretrained(target)
        return None
    why = _NO_FILES.get(kind, "no Hugging Face tokenizer files are written for it")
    return f"--tokenizer-type={kind}: the tokenizer is not exported ({why}); the weights and config.json are"
