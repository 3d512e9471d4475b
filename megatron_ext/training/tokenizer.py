"""The tokenizer, as Megatron-LM builds it from its flags (megatron.core.tokenizers.utils.build_tokenizer).

    --tokenizer-type NullTokenizer --vocab-size V        ids 0..V-1, end-of-document = V-1
    --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR   (a saved tokenizer directory)
    --tokenizer-type SentencePieceTokenizer|GPTSentencePieceTokenizer|Llama2Tokenizer --tokenizer-model M.model
    --tokenizer-type TikTokenizer --tokenizer-model VOCAB.json
    --tokenizer-type SFTTokenizer --tokenizer-model DIR --sft-tokenizer-prompt-format F   (a Hugging Face
                                                          tokenizer with a prompt format's chat template)

The vocabulary size (padded to --make-vocab-size-divisible-by x TP, as megatron pads it) and the
end-of-document id come from the tokenizer, so --vocab-size is needed only by NullTokenizer (and
read by TikTokenizer); a recipe's vocab_size that disagrees with another tokenizer gives way to it,
one given on the command line is refused. Files are checked before any compute and refused by flag name.
"""
from __future__ import annotations

import importlib.util
import os

from megatron_ext.errors import ConfigError
from megatron_ext.sft import PROMPT_FORMATS

# --tokenizer-type -> (the flags naming its files, the package megatron loads it with)
_NEEDS = {
    "GPT2BPETokenizer": (("vocab_file", "merge_file"), "transformers"),
    "BertWordPieceLowerCase": (("vocab_file",), "transformers"),
    "BertWordPieceCase": (("vocab_file",), "transformers"),
    "HuggingFaceTokenizer": (("tokenizer_model",), "transformers"),
    "SentencePieceTokenizer": (("tokenizer_model",), "sentencepiece"),
    "GPTSentencePieceTokenizer": (("tokenizer_model",), "sentencepiece"),
    "Llama2Tokenizer": (("tokenizer_model",), "sentencepiece"),
    "TikTokenizer": (("tokenizer_model",), "tiktoken"),
    "SFTTokenizer": (("tokenizer_model",), "transformers"),
    "NullTokenizer": ((), None),
}
_KEY_FIELDS = (
    "tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "special_tokens",
    "metadata_path", "null_tokenizer_eod_id", "null_tokenizer_pad_id", "tiktoken_pattern",
    "tiktoken_num_special_tokens", "tokenizer_hf_no_use_fast", "tokenizer_hf_no_include_special_tokens",
    "trust_remote_code", "tokenizer_sentencepiece_legacy", "tokenizer_sentencepiece_ignore_extra_whitespaces",
    "chat_template", "sft_tokenizer_prompt_format",
)
_CACHE: dict = {}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _looks_like_hub_id(name: str) -> bool:
    """'org/model': megatron hands it to transformers, which resolves it from its cache or the hub."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.splitext(name)[1]


def check(args) -> None:
    """Refuse, by flag name, a tokenizer that cannot be built here (before megatron would fail)."""
    kind = args.tokenizer_type
    if kind is None:
        raise ConfigError(
            "--tokenizer-type is required (e.g. NullTokenizer --vocab-size 257 for the byte-level data "
            "of scripts/prepare_data.py, or GPT2BPETokenizer --vocab-file F --merge-file F)"
        )
    if kind not in _NEEDS:
        raise ConfigError(f"--tokenizer-type={kind}: not a text tokenizer for GPT pretraining")
    files, package = _NEEDS[kind]
    if kind == "SFTTokenizer" and args.sft_tokenizer_prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"--sft-tokenizer-prompt-format={args.sft_tokenizer_prompt_format}: one of "
                          f"{', '.join(PROMPT_FORMATS)} (megatron's SFTTokenizer)")
    if kind == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type=NullTokenizer needs --vocab-size (257 for scripts/prepare_data.py's byte-level data)")
    for dest in files:
        value = getattr(args, dest)
        if value is None:
            raise ConfigError(f"--tokenizer-type={kind} needs {_flag(dest)}")
        if not os.path.exists(value) and not (kind == "HuggingFaceTokenizer" and _looks_like_hub_id(value)):
            raise ConfigError(f"{_flag(dest)}={value}: no such file or directory")
    if package and importlib.util.find_spec(package) is None:
        raise ConfigError(f"--tokenizer-type={kind} needs the '{package}' package, which is not installed")


def build(args):
    """megatron's tokenizer for these flags (built once per distinct set of tokenizer flags)."""
    check(args)
    key = tuple(repr(getattr(args, f, None)) for f in _KEY_FIELDS)
    if key not in _CACHE:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        from megatron_ext import seams

        view = _TokenizerArgs(args)
        try:
            # local vocab/merges files for GPT2BPETokenizer, no hub look-up: while megatron builds it
            with seams.LOCAL_FILES_TOKENIZER.applied():
                _CACHE[key] = build_tokenizer(view)
        except (ValueError, AssertionError, OSError) as e:
            files = " ".join(f"{_flag(d)}={getattr(args, d)}" for d in _NEEDS[args.tokenizer_type][0])
            raise ConfigError(f"--tokenizer-type={args.tokenizer_type} {files}: {str(e).splitlines()[0]}") from None
    return _CACHE[key]


class _TokenizerArgs:
    """The flags, with padding left to padded_vocab_size() (megatron's builder pads into args)."""

    def __init__(self, args):
        self._args = args
        self.pad_vocab_size = False

    def __getattr__(self, name):
        return getattr(self._args, name)


def padded_vocab_size(args, vocab_size: int | None = None) -> int:
    """As megatron pads it (build_tokenizer.vocab_size_with_padding): a multiple of divisible_by x TP."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    size = build(args).vocab_size if vocab_size is None else vocab_size
    return vocab_size_with_padding(size, args, logging_enabled=False)


def configure(args) -> None:
    """Build the tokenizer from the flags and set args.padded_vocab_size from it (unless given); the
    vocabulary size is the tokenizer's (:func:`vocab_from_tokenizer`)."""
    tokenizer = build(args)
    vocab_from_tokenizer(args, tokenizer.vocab_size)
    if args.padded_vocab_size is None:
        pad = args.pad_vocab_size
        args.padded_vocab_size = padded_vocab_size(args, tokenizer.vocab_size) if pad else tokenizer.vocab_size
    elif args.padded_vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"--padded-vocab-size={args.padded_vocab_size}: below the tokenizer's {tokenizer.vocab_size} ids"
        )


def vocab_from_tokenizer(args, vocab_size: int) -> None:
    """--vocab-size is the tokenizer's for every tokenizer but the NullTokenizer (whose size it sets): a
    recipe's that disagrees gives way, with one line saying so (the checkpoint then records none); one
    given on the command line is refused."""
    if args.tokenizer_type == "NullTokenizer" or args.vocab_size is None or args.vocab_size == vocab_size:
        return
    if args.config_sources.get("vocab_size") == "cli":
        raise ConfigError(f"--vocab-size={args.vocab_size}: the {args.tokenizer_type} has {vocab_size} ids (the "
                          "vocabulary size comes from the tokenizer: leave --vocab-size out)")
    if args.rank == 0:
        print(f"note: the recipe's vocab_size {args.vocab_size} gives way to the {args.tokenizer_type}'s "
              f"{vocab_size} ids", flush=True)
    args.config_sources["vocab_size"] = f"the tokenizer (the recipe's {args.vocab_size} gave way)"
    args.vocab_size = vocab_size
