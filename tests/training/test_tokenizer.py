"""Tokenizer flags build megatron's tokenizer; scripts/prepare_data.py takes the same flags.

Real tokenizers are made here, from this Python's standard library, with well-kept libraries
(`tokenizers` for a GPT-2-style byte-level BPE and a tokenizer.json, `sentencepiece` for a Llama-2
style model): nothing is downloaded.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import arguments
from megatron_ext.errors import ConfigError
from tests.dist import run_distributed
from tests.training import local_tokenizers
from tests.training.local_tokenizers import CORPUS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "recipes", "tiny_dense.yaml")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A GPT-2 vocab.json/merges.txt, a tokenizer.json folder and a sentencepiece model."""
    return local_tokenizers.make(tmp_path_factory.mktemp("tokenizers"))


def recipe_without_vocab(tmp_path) -> str:
    """tiny_dense without its byte-level tokenizer lines: a real tokenizer brings its own vocabulary."""
    keep = [l for l in open(TINY).read().splitlines() if not l.startswith(("vocab_size", "tokenizer_type"))]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(keep) + "\n")
    return str(path)


def parse(*argv):
    return arguments.parse(list(argv), exit_on_dry_run=False)


def test_gpt2_bpe_from_local_vocab_and_merges(made, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from megatron_ext.training import tokenizer

    args = parse("--recipe", recipe_without_vocab(tmp_path), "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", made["vocab"], "--merge-file", made["merges"], "--tensor-model-parallel-size", "2",
                 "--world-size", "2", "--dry-run")
    tok = tokenizer.build(args)
    reference = ByteLevelBPETokenizer(made["vocab"], made["merges"])
    assert tok.vocab_size == reference.get_vocab_size() == 600
    assert args.vocab_size is None  # not needed
    assert args.padded_vocab_size == math.ceil(600 / (80 * 2)) * 80 * 2  # megatron's padding: divisible_by x TP
    assert tok.eod == reference.token_to_id("<|endoftext|>")
    text = open(CORPUS[0], encoding="utf-8").read()[:2000]
    assert list(tok.tokenize(text)) == reference.encode(text).ids


def test_huggingface_tokenizer_folder(made, tmp_path):
    from transformers import AutoTokenizer

    from megatron_ext.training import tokenizer

    args = parse("--recipe", recipe_without_vocab(tmp_path), "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", made["hf"])
    tok, reference = tokenizer.build(args), AutoTokenizer.from_pretrained(made["hf"])
    assert tok.eod == reference.eos_token_id and tok.vocab_size == len(reference)
    assert args.padded_vocab_size == 640


def test_sentencepiece_llama2_tokenizer(made, tmp_path):
    import sentencepiece as spm

    from megatron_ext.training import tokenizer

    args = parse("--recipe", recipe_without_vocab(tmp_path), "--tokenizer-type", "Llama2Tokenizer",
                 "--tokenizer-model", made["sp"])
    tok, reference = tokenizer.build(args), spm.SentencePieceProcessor(model_file=made["sp"])
    assert tok.vocab_size == reference.get_piece_size() == 400
    assert tok.eod == reference.eos_id() != 399  # the model's </s>, not NullTokenizer's vocab_size-1
    assert list(tok.tokenize("import json")) == reference.encode("import json")


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--tokenizer-type", "GPT2BPETokenizer", "--merge-file", "M"], r"--tokenizer-type=GPT2BPETokenizer, --vocab-file=None.*reads --vocab-file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "V", "--merge-file", "/no/merges.txt"],
         r"--merge-file=/no/merges.txt: no such file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/vocab.json", "--merge-file", "M"],
         r"--vocab-file=/no/vocab.json: no such file"),
        (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/no/tokenizer.model"],
         r"--tokenizer-model=/no/tokenizer.model: no such file"),
        (["--tokenizer-type", "HuggingFaceTokenizer"], r"--tokenizer-type=HuggingFaceTokenizer, --tokenizer-model=None.*reads --tokenizer-model"),
        (["--tokenizer-type", "NullTokenizer"], r"NullTokenizer needs --vocab-size"),
    ],
)
def test_missing_tokenizer_files_are_refused_by_name(made, tmp_path, flags, match):
    flags = [made["vocab"] if f == "V" else made["merges"] if f == "M" else f for f in flags]
    with pytest.raises(ConfigError, match=match):
        parse("--recipe", recipe_without_vocab(tmp_path), *flags)


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [np.array(ds[i]) for i in range(len(ds))]  # copies: the views die with the mmap


def test_prepare_data_takes_megatrons_tokenizer_flags(made, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from scripts import prepare_data

    docs = [{"text": open(p, encoding="utf-8").read()[:500], "title": os.path.basename(p)} for p in CORPUS[:6]]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    # as a user runs it (a fresh process: its --workers are forked, as Megatron-LM's tool does)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "prepare_data.py"), "--input", str(src), "--json-keys", "text",
         "title", "--output-prefix", str(tmp_path / "bpe"), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
         made["vocab"], "--merge-file", made["merges"], "--append-eod", "--workers", "2"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"done: {len(docs)} documents" in done.stdout
    reference = ByteLevelBPETokenizer(made["vocab"], made["merges"])
    eod = reference.token_to_id("<|endoftext|>")
    for key in ("text", "title"):
        got = _read(str(tmp_path / f"bpe_{key}_document"))
        assert [g.tolist() for g in got] == [reference.encode(d[key]).ids + [eod] for d in docs]
    # without --append-eod, as Megatron-LM's tool: no end-of-document
    prepare_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "noeod"), "--tokenizer-type",
                       "GPT2BPETokenizer", "--vocab-file", made["vocab"], "--merge-file", made["merges"]])
    assert [g.tolist() for g in _read(str(tmp_path / "noeod_text_document"))] == [reference.encode(d["text"]).ids for d in docs]


def test_prepare_data_byte_level_default(tmp_path):
    from scripts import prepare_data

    raw = "héllo\n".encode() + b"\xff"  # not valid UTF-8: bytes are kept as they are
    (tmp_path / "a.txt").write_bytes(raw)
    prepare_data.main(["--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "bytes")])
    assert [g.tolist() for g in _read(str(tmp_path / "bytes_text_document"))] == [list(raw) + [256]]


def test_dataset_masks_the_tokenizers_end_of_document(made, tmp_path):
    """--eod-mask-loss masks the tokenizer's eod (here id 0, not NullTokenizer's vocab_size-1)."""
    from scripts import prepare_data

    from megatron_ext.training import data

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": open(p, encoding="utf-8").read()[:300]}) + "\n" for p in CORPUS))
    prepare_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
                       "GPT2BPETokenizer", "--vocab-file", made["vocab"], "--merge-file", made["merges"], "--append-eod"])
    args = parse("--recipe", recipe_without_vocab(tmp_path), "--tokenizer-type", "GPT2BPETokenizer",
                 "--vocab-file", made["vocab"], "--merge-file", made["merges"], "--data-path",
                 str(tmp_path / "d_text_document"), "--eod-mask-loss", "--train-iters", "4", "--data-cache-path",
                 str(tmp_path / "cache"))
    train, _, _ = data.build_datasets(args)
    eods = 0
    for i in range(8):
        sample = train[i]
        is_eod = sample["tokens"] == 0
        assert bool((sample["loss_mask"][is_eod] == 0).all()) and bool((sample["loss_mask"][~is_eod] == 1).all())
        eods += int(is_eod.sum())
    assert eods > 0


def test_trains_on_bpe_data(made, tmp_path):
    from scripts import prepare_data

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": open(p, encoding="utf-8").read()}) + "\n" for p in CORPUS))
    prepare_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
                       "GPT2BPETokenizer", "--vocab-file", made["vocab"], "--merge-file", made["merges"], "--append-eod"])
    argv = ["--recipe", recipe_without_vocab(tmp_path), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            made["vocab"], "--merge-file", made["merges"], "--data-path", str(tmp_path / "d_text_document"),
            "--train-iters", "3", "--lr-warmup-iters", "1", "--log-interval", "100", "--data-cache-path",
            str(tmp_path / "cache"), "--world-size", "2"]
    history = run_distributed(2, "tests.training.jobs:train", argv=argv)[-1]
    losses = [r["lm loss"] for r in history]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(640)) < 1.0  # starts near uniform over the padded BPE vocabulary
