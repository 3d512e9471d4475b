"""Turn text into a Megatron indexed dataset (PREFIX_<key>_document.bin/.idx).

With Megatron-LM's tokenizer flags, as its tools/preprocess_data.py (megatron's tokenizer builder):
    python scripts/prepare_data.py --input docs.jsonl --json-keys text --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 2
    -> data/my_text_document.bin/.idx; train with the same tokenizer flags and --data-path data/my_text_document

Without --tokenizer-type, byte-level (nothing to download): every file is one document, its UTF-8
bytes (ids 0..255) and end-of-document (256) after it; train with
`--tokenizer-type NullTokenizer --vocab-size 257`.
    python scripts/prepare_data.py --input DIR_OR_FILE [...] --output-prefix data/mytext
    python scripts/prepare_data.py --python-stdlib --output-prefix data/pystdlib

--input takes JSON-lines files (.json/.jsonl: one document per line, text under --json-keys), and
text files or directories (one document per file). `--python-stdlib` reads this interpreter's own
standard-library sources, present on every machine.

No tokenizer for your corpus yet: `--train-tokenizer VOCAB_SIZE` trains a byte-level BPE of that many
ids on the input (the `tokenizers` library, offline), saves it as a Hugging Face tokenizer directory,
PREFIX_tokenizer/, and tokenizes with it; train with `--tokenizer-type HuggingFaceTokenizer
--tokenizer-model PREFIX_tokenizer` (each checkpoint records it and copies its files; an export writes them):
    python scripts/prepare_data.py --input docs.jsonl --train-tokenizer 8192 --output-prefix data/my

Chat data for `train.py --sft` is not prepared here: it is read as JSON lines (megatron_ext/sft).
`--chat-example DIR` writes a small one and a tokenizer for it (what recipes/tiny_sft.yaml trains on):
    python scripts/prepare_data.py --chat-example recipes/tiny_sft
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import sysconfig
import time

import numpy as np

from megatron_ext import errors, helptext
from megatron_ext.errors import InputError  # not SystemExit: the worker pool's feeder hangs on anything but an Exception

BYTE_EOD = 256  # megatron_ext.training.data.BYTE_EOD (not imported here: it imports megatron-core)
TRAINED_SPECIAL = ["<|endoftext|>"]  # a trained tokenizer's special tokens: its end of document
JSON_SUFFIXES = (".json", ".jsonl")


def stdlib_files(limit_mb: float) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    chosen, total = [], 0
    for path in files:
        size = os.path.getsize(path)
        if total + size > limit_mb * 2**20:
            break
        chosen.append(path)
        total += size
    return chosen


def text_files(inputs: list[str], suffixes: tuple[str, ...]) -> list[str]:
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for dirpath, dirnames, filenames in os.walk(item):
                dirnames.sort()
                files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(suffixes)]
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise SystemExit(f"error: --input {item}: no such file or directory")
    return files


def documents(files: list[str], json_keys: list[str]):
    """(key, text, bytes read) for every document: each JSON line's --json-keys, or each text file."""
    for path in files:
        if path.endswith(JSON_SUFFIXES):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}:{n}: not a JSON line ({e})") from None
                    for key in json_keys:
                        if key not in record:
                            raise InputError(f"{path}:{n}: no key '{key}' (--json-keys)")
                        yield key, _text(record[key], key, f"{path}:{n}"), len(line)
        else:
            with open(path, "rb") as f:
                raw = f.read()
            yield json_keys[0], raw, len(raw)  # bytes: the byte-level tokenizer keeps them exactly


def _text(value, key: str, where: str) -> str:
    """A document's text: a string, or a list of strings (sentences) joined as preprocess_data.py does."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "".join(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) and "role" in v for v in value):
        raise InputError(
            f"{where}: --json-keys {key}: a list of chat messages, not text; chat data is not "
            "tokenized here: train.py --sft reads such JSON lines ({\"messages\": [...]}) as they are"
        )
    raise InputError(f"{where}: --json-keys {key}: a {type(value).__name__}, not text (a string or a list of strings)")


class _Encoder:
    """Per worker process: the tokenizer built once from the flags (preprocess_data.py's Encoder)."""

    tokenizer = None

    def __init__(self, args):
        self.args = args

    def initializer(self):
        _Encoder.tokenizer = build_tokenizer(self.args)

    def encode(self, item):
        from megatron_ext.training.data import ByteTokenizer

        key, text, nbytes = item
        tok = _Encoder.tokenizer
        if isinstance(tok, ByteTokenizer):
            raw = text if isinstance(text, bytes) else text.encode("utf-8")
            ids = np.frombuffer(raw, dtype=np.uint8).astype(np.uint16)
        else:
            ids = np.asarray(tok.tokenize(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text))
        if len(ids) and self.args.append_eod:
            ids = np.append(ids, tok.eod)
        return key, ids, nbytes


def build_tokenizer(args):
    """Byte-level without --tokenizer-type; else megatron's tokenizer, exactly as training builds it."""
    from megatron_ext.training.data import ByteTokenizer

    if args.tokenizer_type is None:
        return ByteTokenizer()
    from megatron_ext.training import tokenizer

    return tokenizer.build(args)


def train_tokenizer(args, files: list[str]) -> str:
    """A byte-level BPE of --train-tokenizer ids trained on the documents' text, saved as a Hugging Face
    tokenizer directory PREFIX_tokenizer (written aside, renamed into place): its path."""
    import shutil

    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    size, alphabet = args.train_tokenizer, 256 + len(TRAINED_SPECIAL)
    if size < alphabet:
        raise InputError(f"--train-tokenizer={size}: below the byte alphabet (256 bytes + {len(TRAINED_SPECIAL)} "
                         f"special token = {alphabet} ids)")
    seen = [0]

    def texts():
        for _, text, _ in documents(files, args.json_keys):
            text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
            seen[0] += len(text)
            yield text

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts(), vocab_size=size, min_frequency=2, special_tokens=TRAINED_SPECIAL,
                            show_progress=False)
    if not seen[0]:
        raise InputError(f"--train-tokenizer={size}: the corpus is empty (no text in {len(files)} input files)")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=TRAINED_SPECIAL[0])
    directory = f"{args.output_prefix}_tokenizer"
    partial = f"{directory}.partial-{os.getpid()}"
    try:
        tokenizer.save_pretrained(partial)
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(partial, directory)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"trained a byte-level BPE of {len(tokenizer)} ids -> {directory}/ (train with --tokenizer-type "
          f"HuggingFaceTokenizer --tokenizer-model {directory})", flush=True)
    return directory


def build(args, files: list[str], progress_every: float = 2.0) -> dict:
    """Write every key's dataset under a temporary name, renamed into place only once complete: a
    failure (a bad line, an interrupt) leaves no partial .bin/.idx, and an earlier dataset intact."""
    from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path

    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    os.makedirs(os.path.dirname(args.output_prefix) or ".", exist_ok=True)
    partial = {key: f"{p}.partial-{os.getpid()}" for key, p in prefixes.items()}
    try:
        result = _build(args, files, partial, progress_every)
        for key, prefix in prefixes.items():
            os.replace(get_bin_path(partial[key]), get_bin_path(prefix))
            os.replace(get_idx_path(partial[key]), get_idx_path(prefix))  # last: a reader opens the .idx first
    finally:
        for p in partial.values():
            for path in (get_bin_path(p), get_idx_path(p)):
                if os.path.exists(path):
                    os.remove(path)
    key = args.json_keys[0]
    return {**result, "prefix": prefixes[key], "prefixes": prefixes}


def _build(args, files: list[str], prefixes: dict, progress_every: float) -> dict:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    tok = build_tokenizer(args)
    dtype = np.uint16 if args.tokenizer_type is None else DType.optimal_dtype(tok.vocab_size)
    builders = {}
    try:
        for key, p in prefixes.items():
            builders[key] = IndexedDatasetBuilder(get_bin_path(p), dtype=dtype)
        counts = _add_documents(args, files, builders, dtype, tok, progress_every)
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()  # build() removes the partial files
        raise
    for key, builder in builders.items():
        builder.finalize(get_idx_path(prefixes[key]))
    key = args.json_keys[0]
    return {"documents": counts[key][0], "tokens": counts[key][1], "vocab_size": tok.vocab_size, "eod": tok.eod}


def _add_documents(args, files: list[str], builders: dict, dtype, tok, progress_every: float) -> dict:
    encoder = _Encoder(args)
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, documents(files, args.json_keys), 32)
    else:
        pool, _Encoder.tokenizer = None, tok
        encoded = map(encoder.encode, documents(files, args.json_keys))
    counts = {key: [0, 0] for key in args.json_keys}  # documents, tokens
    start = last = time.perf_counter()
    nbytes = 0
    try:
        for i, (key, ids, size) in enumerate(encoded, 1):
            nbytes += size
            if not len(ids):
                continue
            builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            counts[key][0] += 1
            counts[key][1] += len(ids)
            now = time.perf_counter()
            if now - last >= progress_every or i % args.log_interval == 0:
                last = now
                rate = nbytes / max(now - start, 1e-9) / 2**20
                print(f"  {i} documents | {nbytes / 2**20:.1f} MiB | {rate:.1f} MiB/s", flush=True)
    finally:
        if pool is not None:
            pool.terminate()  # every result is read (or the build failed): nothing left to wait for
            pool.join()
    return counts


def build_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import _add_sft_args, _add_tokenizer_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_tokenizer_args(parser)  # megatron's own tokenizer flags, as tools/preprocess_data.py
    _add_sft_args(parser)  # --sft-tokenizer-prompt-format, which megatron's SFTTokenizer reads
    group = parser.add_argument_group("input data")
    source = group.add_mutually_exclusive_group(required=True)
    source.add_argument("--chat-example", metavar="DIR", help="write DIR/conversations.jsonl and DIR/tokenizer/: "
                        "a small chat data set for train.py --sft, and a tokenizer with a chat template for it")
    source.add_argument("--input", nargs="+", help="JSON-lines files (.json/.jsonl), text files or directories")
    source.add_argument("--python-stdlib", action="store_true", help="this interpreter's stdlib .py files")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="(refused: needs nltk)")
    group.add_argument("--keep-newlines", action="store_true", help="(only with --split-sentences)")
    group.add_argument("--suffixes", nargs="+", default=[".txt", ".md", ".py", ".rst", ".json", ".jsonl"],
                       help="file endings taken from --input directories")
    group.add_argument("--limit-mb", type=float, default=8.0, help="--python-stdlib: at most this much text")
    group.add_argument("--train-tokenizer", type=int, default=None, metavar="VOCAB_SIZE",
                       help="train a byte-level BPE of VOCAB_SIZE ids on the input (offline, the tokenizers "
                       "library), save it as the Hugging Face tokenizer directory PREFIX_tokenizer/ and tokenize "
                       "with it (end-of-document appended)")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true", help="append end-of-document to every document "
                       "(always on byte-level)")
    group.add_argument("--lang", type=str, default="english", help="(only with --split-sentences)")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", help="writes PREFIX_<json key>_document.bin/.idx (required but with --chat-example)")
    group.add_argument("--skip-existing", action="store_true", help="do nothing if the dataset exists")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    group.add_argument("--partitions", type=int, default=1, help="(only 1: one output per key)")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    group.add_argument("--verbose", action="store_true", help="show the third-party warnings filtered by default")
    return parser


def get_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output_prefix is None and not args.chat_example:
        parser.error("the following arguments are required: --output-prefix")
    if args.sft:
        parser.error("--sft: chat data is read as JSON lines by train.py --sft --data-path FILE.jsonl, not prepared here")
    if args.split_sentences:
        parser.error("--split-sentences: sentence splitting needs nltk's punkt data, which is not available here")
    if args.partitions != 1:
        parser.error(f"--partitions={args.partitions}: only 1 is supported")
    if args.train_tokenizer is not None and (args.tokenizer_type is not None or args.chat_example):
        parser.error(f"--train-tokenizer={args.train_tokenizer}: trains the tokenizer it tokenizes with; leave out "
                     + ("--tokenizer-type" if args.tokenizer_type is not None else "--chat-example"))
    if args.tokenizer_type is None:
        args.append_eod = True  # byte-level documents always end in BYTE_EOD
    # as tools/preprocess_data.py: the tokenizer's own vocabulary, unpadded
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 0, 1, 1
    args.vocab_extra_ids = 0
    return args


def _render_help() -> str:
    from megatron_ext import platform

    platform.setup()  # before megatron-core is imported
    return build_parser().format_help()


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:  # a cached text: neither torch nor megatron-core is imported
        helptext.show("prepare_data", __file__, _render_help)
    from megatron_ext import platform

    errors.quiet(argv)  # third-party warnings that tell the user nothing (--verbose shows them)
    platform.setup()  # before megatron-core is imported
    args = get_args(argv)
    from megatron_ext.errors import ConfigError

    if args.chat_example:
        from megatron_ext.sft import example

        written = example.write(args.chat_example)
        print(f"wrote {written['data']} and {written['tokenizer']}/", flush=True)
        return written

    prefix = f"{args.output_prefix}_{args.json_keys[0]}_document"
    if args.skip_existing and os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin"):
        print(f"{prefix}.bin/.idx exist; skipping")
        return {"prefix": prefix, "skipped": True}
    files = stdlib_files(args.limit_mb) if args.python_stdlib else text_files(args.input, tuple(args.suffixes))
    if not files:
        raise SystemExit("error: no input files found")
    if args.train_tokenizer is not None:
        try:
            trained = train_tokenizer(args, files)
        except InputError as e:
            raise SystemExit(f"error: {e}") from None
        args.tokenizer_type, args.tokenizer_model, args.append_eod = "HuggingFaceTokenizer", trained, True
    try:
        build_tokenizer(args)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    kind = "byte-level, eod=%d" % BYTE_EOD if args.tokenizer_type is None else args.tokenizer_type
    print(f"tokenizing {len(files)} files ({kind}) -> {prefix}.bin/.idx", flush=True)
    try:
        result = build(args, files)
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
    print(f"done: {result['documents']} documents, {result['tokens']} tokens", flush=True)
    if args.train_tokenizer is not None:
        result["tokenizer"] = args.tokenizer_model
    return result


if __name__ == "__main__":
    main()
