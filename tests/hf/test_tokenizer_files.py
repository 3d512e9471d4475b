"""A SentencePiece run's tokenizer goes to Hugging Face (megatron_ext/hf/tokenizer_files.py) where it is
exact: tiny models trained offline by sentencepiece's trainer, each written by the export's tokenizer
function, and AutoTokenizer on the directory gives megatron's ids (its SentencePieceTokenizer's
``tokenize``) on held-out text that decided nothing: other source files than the trainer saw, spaces,
control pieces spelled out, scripts the models lack. A model the export finds inexact (a word model;
nmt_nfkc keeping extra whitespace without a dummy prefix), extra whitespace megatron keeps that the
model's normalizer drops, and special tokens megatron splits out itself are refused in one line each,
no tokenizer file left behind; the run's first documents, where its data is here, are checked too."""
from __future__ import annotations

import glob
import os
import sysconfig

import pytest

from tests.scripts import load_script

STDLIB = sysconfig.get_paths()["stdlib"]
VOCAB = 500
# model name -> sentencepiece trainer options (over VOCAB pieces; byte fallback adds its 256)
EXACT = {
    "bpe identity": dict(model_type="bpe", normalization_rule_name="identity"),
    "bpe nmt_nfkc, byte fallback": dict(model_type="bpe", normalization_rule_name="nmt_nfkc", byte_fallback=True),
    "unigram identity, extra whitespace kept": dict(model_type="unigram", normalization_rule_name="identity",
                                                    remove_extra_whitespaces=False),
    "unigram nmt_nfkc_cf, byte fallback, user-defined": dict(model_type="unigram",
                                                             normalization_rule_name="nmt_nfkc_cf", byte_fallback=True,
                                                             user_defined_symbols=["<tool>", "json"]),
    "char": dict(model_type="char"),
}
REFUSED = {
    "word": dict(model_type="word"),
    "bpe nmt_nfkc, extra whitespace kept, no dummy prefix": dict(
        model_type="bpe", normalization_rule_name="nmt_nfkc", remove_extra_whitespaces=False, add_dummy_prefix=False),
}


def _files(package: str) -> list[str]:
    return sorted(glob.glob(os.path.join(STDLIB, package, "*.py")))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each model of EXACT and REFUSED trained on three json/ sources of the standard library."""
    import sentencepiece

    root = tmp_path_factory.mktemp("sentencepiece")
    lines = [line for f in _files("json")[:3] for line in open(f, encoding="utf-8").read().splitlines()]
    paths = {}
    for i, (name, options) in enumerate({**EXACT, **REFUSED}.items()):
        prefix = str(root / f"m{i}")
        size = VOCAB + 256 * options.get("byte_fallback", False)
        sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=size,
                                                 hard_vocab_limit=False, minloglevel=2,
                                                 **options)
        paths[name] = prefix + ".model"
    return root, paths


def _run_tokenizer(model: str, *flags: str):
    """The flags as the run has them, and megatron's tokenizer built from them (as training builds it)."""
    prepare = load_script("prepare_data")
    args = prepare.get_args(["--input", "x", "--output-prefix", "x", "--tokenizer-type", "SentencePieceTokenizer",
                             "--tokenizer-model", model, *flags])
    return args, prepare.build_tokenizer(args)


def _held_out() -> list[str]:
    """email/ sources in chunks (the models saw json/; the export checked its own sample), and text the
    sample does not hold."""
    text = "".join(open(f, encoding="utf-8").read() for f in _files("email")[:2])
    return [text[i:i + 500] for i in range(0, len(text), 500)] + [
        "  Ünïcödé\t\tdigits 42  ", "ｈｅｌｌｏ ①② ¼ Å", "Ελληνικά και русский текст", "</s>end<s> <unk>x",
        "<tool>json</tool>", "▁▁ ▁", "<0x41>", "trailing\n\n  ", "\u200bzero\u2028width", "🙂" * 3 + "a" * 40]


def test_every_model_the_export_accepts_gives_megatrons_ids(models, tmp_path):
    from transformers import AutoTokenizer

    from megatron_ext.hf import tokenizer_files

    _, paths = models
    held_out = _held_out()
    for name in EXACT:
        args, megatron_tokenizer = _run_tokenizer(paths[name])
        out = tmp_path / name.replace(" ", "_").replace(",", "")
        out.mkdir()
        assert tokenizer_files.write(args, str(out)) is None, name
        exported = AutoTokenizer.from_pretrained(str(out))
        for text in held_out:
            assert exported(text)["input_ids"] == list(megatron_tokenizer.tokenize(text)), (name, text)
        assert exported.eos_token_id == megatron_tokenizer.eod, name
        assert len(exported(held_out[0])["input_ids"]) > 50, name
        assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"], name
    # megatron-core encodes with GPTSentencePieceTokenizer and Llama2Tokenizer as with SentencePieceTokenizer:
    # the same files
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        args.tokenizer_type = kind
        (tmp_path / kind).mkdir()
        assert tokenizer_files.write(args, str(tmp_path / kind)) is None, kind
        for name in os.listdir(out):
            assert (tmp_path / kind / name).read_bytes() == (out / name).read_bytes(), (kind, name)



def test_the_runs_documents_are_checked_where_its_data_is_here(models, tmp_path):
    """--data-path's prefixes on this machine (a blend weight and a missing prefix passed over): the
    text of their first documents, as megatron detokenizes their ids, is among the texts checked."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    from megatron_ext.hf import tokenizer_files

    args, megatron_tokenizer = _run_tokenizer(models[1]["bpe identity"])
    documents = ["first  document", "the second", "third"] + ["more"] * 3
    prefix = str(tmp_path / "data")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for text in documents:
        ids = list(megatron_tokenizer.tokenize(text)) + [megatron_tokenizer.eod]
        builder.add_document(np.asarray(ids, dtype=np.uint16), [len(ids)])
    builder.finalize(get_idx_path(prefix))
    args.data_path = ["0.5", prefix, "0.5", str(tmp_path / "elsewhere")]
    checked = tokenizer_files._documents(args, megatron_tokenizer)
    assert checked == [megatron_tokenizer.detokenize(megatron_tokenizer.tokenize(t)) for t in documents[:4]], checked
    assert checked[:2] == ["first document", "the second"]  # (the model's normalizer removes extra spaces)


def test_what_is_not_exact_is_refused_in_one_line_with_no_tokenizer_files(models, tmp_path):
    from megatron_ext.hf import tokenizer_files

    _, paths = models
    cases = [_run_tokenizer(paths["word"])[0], _run_tokenizer(paths[list(REFUSED)[1]])[0],
             _run_tokenizer(paths["bpe identity"], "--no-tokenizer-sentencepiece-ignore-extra-whitespaces")[0],
             _run_tokenizer(paths["bpe identity"], "--tokenizer-sentencepiece-legacy",
                            "--tokenizer-special-tokens", "<tool>", "<call>")[0]]
    lines = []
    for i, args in enumerate(cases):
        out = tmp_path / str(i)
        out.mkdir()
        (out / "config.json").write_text("{}")  # the export's, written before: kept
        lines.append(tokenizer_files.write(args, str(out)))
        assert os.listdir(out) == ["config.json"], (i, os.listdir(out))
    refused = "--tokenizer-type=SentencePieceTokenizer: the tokenizer is not exported (AutoTokenizer gives other ids " \
              "than megatron's for {}: a sentencepiece {}); the weights and config.json are"
    assert lines == [
        refused.format("' one leading space'", "word model, nmt_nfkc normalization"),
        refused.format(repr("line one\r\nline two"), "bpe model, nmt_nfkc normalization, extra whitespace kept, "
                                                     "no dummy prefix"),
        refused.format("' '", "bpe model, identity normalization"),
        "--tokenizer-special-tokens=<tool>,<call>: the SentencePieceTokenizer is not exported (megatron's "
        "SentencePiece wrapper splits these out of the text itself, and drops a lone metaspace after them); the "
        "weights and config.json are"], lines
