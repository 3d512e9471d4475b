"""The run's tokenizer as Hugging Face tokenizer files (an export writes them beside the weights), so that
``AutoTokenizer.from_pretrained(OUT)`` gives the ids the run trained on:

    HuggingFaceTokenizer, SFTTokenizer   its directory's files, as they are (no weights; the export then
                                         writes the model's config.json), or a hub id's, saved
    GPT2BPETokenizer                     transformers' GPT2TokenizerFast from --vocab-file and --merge-file
                                         (byte-level BPE, <|endoftext|> its end of document)
    SentencePieceTokenizer,              --tokenizer-model as tokenizer.model, and the tokenizer.json
    GPTSentencePieceTokenizer,           transformers builds from it (TokenizersBackend: the model's pieces
    Llama2Tokenizer                      and scores, its normalizer's character map, its whitespace rules),
                                         verified: kept only where AutoTokenizer gives megatron's ids on
                                         every text of SAMPLE and on the run's first documents

Any other kind has no Hugging Face files here: ``write`` returns the one line that says so (the weights
are written all the same). The byte-level NullTokenizer (ids 0..255 are bytes, then end-of-document) has
no Hugging Face tokenizer class."""
from __future__ import annotations

import json
import os
import shutil

from megatron_ext.hf import hfdir

GPT2_EOD = "<|endoftext|>"
MODEL_FILES = ("config.json", "generation_config.json")  # another model's, where its tokenizer was borrowed
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# the texts every SentencePiece export is checked on: spaces the model's normalizer may drop, collapse or
# keep, other whitespace, digits, compatibility characters its normalizer may rewrite, scripts and
# symbols a small model lacks, a literal metaspace and control piece
SAMPLE = (
    "", " ", "   ", "Hello, world.", " one leading space", "   three leading, two  inner and trailing  ",
    "tabs\tand\nnew\n\nlines\n", "line one\r\nline two", " \n \n ", "x  y", "digits 0123456789 3.14159 1,000,000",
    "naïve café Ünïcödé ﬁ ① ｆｕｌｌ ideographic\u3000space a\u00a0nbsp", "日本語のテキスト 中文 한국어",
    "emoji 🙂👍🏽", "▁a metaspace", "trailing metaspaces▁▁", " ▁", "def f(x):\n    return {'k': [1, 2]}  # done\n",
)
DOCUMENTS, DOCUMENT_TOKENS = 4, 2048  # the run's documents checked too, where its data is reachable
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
    if kind in SENTENCEPIECE:
        return _sentencepiece(args, target)
    why = _NO_FILES.get(kind, "no Hugging Face tokenizer files are written for it")
    return f"--tokenizer-type={kind}: the tokenizer is not exported ({why}); the weights and config.json are"


def _sentencepiece(args, target: str) -> str | None:
    """tokenizer.model and the tokenizer.json transformers converts it to, kept where AutoTokenizer on
    ``target`` gives megatron's ids (``tokenize``) on every text checked; else none are kept.

    transformers builds the tokenizers-library equivalent of the model (TokenizersBackend from a
    tokenizer.model: its pieces and scores or merges, its normalizer's character map, its whitespace
    rules). So that it encodes as sentencepiece does, special tokens spelled in the text are not
    matched (split_special_tokens: sentencepiece reads "</s>" in text as characters), and two rules
    are written into its tokenizer.json (_as_sentencepiece)."""
    from transformers import AutoTokenizer

    from megatron_ext.training import tokenizer as run_tokenizer

    kind = args.tokenizer_type
    if getattr(args, "special_tokens", None):
        return (f"--tokenizer-special-tokens={','.join(args.special_tokens)}: the {kind} is not exported (megatron's "
                "SentencePiece wrapper splits these out of the text itself, and drops a lone metaspace after them); "
                "the weights and config.json are")
    ours = run_tokenizer.build(args)
    proto = _proto(args.tokenizer_model)
    before = set(os.listdir(target))

    def refused(why: str) -> str:  # and the files written here removed
        for name in set(os.listdir(target)) - before:
            os.remove(os.path.join(target, name))
        return f"--tokenizer-type={kind}: the tokenizer is not exported ({why}); the weights and config.json are"

    shutil.copy2(args.tokenizer_model, os.path.join(target, "tokenizer.model"))
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "TokenizersBackend", "add_bos_token": False, "add_eos_token": False,
                   "legacy": True, "split_special_tokens": True}, f)
    try:
        AutoTokenizer.from_pretrained(target).save_pretrained(target)  # tokenizer.json: loads without sentencepiece
        _as_sentencepiece(proto, os.path.join(target, "tokenizer.json"))
        theirs = AutoTokenizer.from_pretrained(target)
    except Exception as e:  # a model transformers cannot convert
        return refused(f"transformers cannot convert this {describe(proto)}: {str(e).splitlines()[0]}")
    unmatched = [p.piece for p in proto.pieces if p.type in _UNMATCHED][:8]
    for text in (*SAMPLE, " ".join(unmatched), "".join(unmatched), *_documents(args, ours)):
        if theirs(text)["input_ids"] != list(ours.tokenize(text)):
            shown = repr(text if len(text) <= 40 else text[:40] + "...")
            return refused(f"AutoTokenizer gives other ids than megatron's for {shown}: a {describe(proto)}")
    return None


# sentencepiece's piece types it never matches in text: unknown, control, unused, byte (NORMAL is 1,
# USER_DEFINED 4: those it matches)
_UNMATCHED = (2, 3, 5, 6)


def _as_sentencepiece(proto, tokenizer_json: str) -> None:
    """Two rules of sentencepiece's encoder that transformers' tokenizer.json lacks, written into it:
    a unigram model's pieces of the _UNMATCHED types score below any path of pieces over the same
    characters (the lowest normal score times one more than their length, less 10), and where extra
    whitespace is removed, the trailing metaspaces go after the text is escaped (sentencepiece strips
    "▁" typed in the text there too, not only spaces)."""
    with open(tokenizer_json, encoding="utf-8") as f:
        state = json.load(f)
    unmatched = [i for i, p in enumerate(proto.pieces) if p.type in _UNMATCHED]
    if state["model"]["type"] == "Unigram" and unmatched:
        lowest = min([p.score for p in proto.pieces if p.type == 1], default=0.0)
        longest = max(len(proto.pieces[i].piece) for i in unmatched)
        vocab = state["model"]["vocab"]
        for i in unmatched:
            assert vocab[i][0] == proto.pieces[i].piece, (i, vocab[i], proto.pieces[i].piece)
            vocab[i][1] = min(lowest, 0.0) * (longest + 1) - 10.0
    spec = proto.normalizer_spec
    if spec.remove_extra_whitespaces and spec.escape_whitespaces:
        normalizer = state["normalizer"]
        steps = normalizer["normalizers"] if normalizer and normalizer["type"] == "Sequence" else \
            [normalizer] if normalizer else []
        steps.append({"type": "Replace", "pattern": {"Regex": "\u2581+\\z"}, "content": ""})
        state["normalizer"] = {"type": "Sequence", "normalizers": steps}
    with open(tokenizer_json, "w", encoding="utf-8") as f:
        json.dump(state, f, ensure_ascii=False)


def _proto(model_file: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_file, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def describe(proto) -> str:
    """'sentencepiece unigram model, nmt_nfkc normalization' (and its options where not the default)."""
    from sentencepiece import sentencepiece_model_pb2

    kind = sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()
    spec = proto.normalizer_spec
    options = [name for name, on in (("byte fallback", proto.trainer_spec.byte_fallback),
                                     ("extra whitespace kept", not spec.remove_extra_whitespaces),
                                     ("no dummy prefix", not spec.add_dummy_prefix)) if on]
    return f"sentencepiece {kind} model, {spec.name or 'user-defined'} normalization" + "".join(
        f", {o}" for o in options)


def _documents(args, ours) -> list[str]:
    """The text of the run's first documents (their first DOCUMENT_TOKENS ids, detokenized), where its
    --data-path prefixes are here."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

    texts = []
    for prefix in getattr(args, "data_path", None) or []:
        if not (os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix))):
            continue  # a blend weight, or data not on this machine
        dataset = IndexedDataset(prefix)
        for i in range(min(DOCUMENTS - len(texts), len(dataset))):
            texts.append(ours.detokenize([int(t) for t in dataset[i][:DOCUMENT_TOKENS]]))
    return texts
