"""Real tokenizers made here from this Python's standard library, with well-kept libraries
(`tokenizers`: a GPT-2-style byte-level BPE vocab.json/merges.txt and a tokenizer.json folder;
`sentencepiece`: a Llama-2-style model) — nothing is downloaded — and data prepared with them."""
from __future__ import annotations

import glob
import json
import os
import sysconfig

CORPUS = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))


def make(out) -> dict:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    out = str(out)
    bpe = ByteLevelBPETokenizer()
    bpe.train(CORPUS, vocab_size=600, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(out)
    hf_dir = os.path.join(out, "hf")
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>").save_pretrained(hf_dir)

    import sentencepiece as spm

    text = os.path.join(out, "corpus.txt")
    with open(text, "w") as f:
        f.write("".join(open(p, encoding="utf-8").read() for p in CORPUS))
    spm.SentencePieceTrainer.train(input=text, model_prefix=os.path.join(out, "sp"), vocab_size=400,
                                   model_type="bpe", minloglevel=2)
    return {"vocab": os.path.join(out, "vocab.json"), "merges": os.path.join(out, "merges.txt"), "hf": hf_dir,
            "sp": os.path.join(out, "sp.model"), "dir": out}


def prepare(out, prefix: str, tokenizer_flags: list[str], documents: int | None = None) -> str:
    """The json corpus as JSON lines (one document per file, or `documents` documents of a few of
    its lines each), through scripts/prepare_data.py with these tokenizer flags."""
    from scripts import prepare_data

    src = os.path.join(str(out), prefix + ".jsonl")
    if documents is None:
        texts = [open(p, encoding="utf-8").read() for p in CORPUS]
    else:
        lines = [l for p in CORPUS for l in open(p, encoding="utf-8").read().splitlines() if l.strip()]
        texts = ["\n".join(lines[(3 * i + k) % len(lines)] for k in range(3)) for i in range(documents)]
    with open(src, "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return prepare_data.main(["--input", src, "--output-prefix", os.path.join(str(out), prefix), "--append-eod",
                              *tokenizer_flags])["prefix"]
