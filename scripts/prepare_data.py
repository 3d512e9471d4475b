"""Turn text files into a Megatron indexed dataset (.bin/.idx) with the byte-level tokenizer.

    python scripts/prepare_data.py --input DIR_OR_FILE [...] --output-prefix data/mytext
    python scripts/prepare_data.py --python-stdlib --output-prefix data/pystdlib

Each file is one document: its UTF-8 bytes (ids 0..255) followed by end-of-document (256). Train on
it with `--data-path data/mytext_text_document --tokenizer-type NullTokenizer --vocab-size 257`.
`--python-stdlib` uses this interpreter's own standard-library sources, present on every machine.
"""
from __future__ import annotations

import argparse
import os
import sysconfig
import time

import numpy as np

from megatron_ext import platform


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


def build(files: list[str], output_prefix: str, progress_every: float = 2.0) -> dict:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    from megatron_ext.training.data import BYTE_EOD

    prefix = output_prefix + "_text_document"
    print(f"tokenizing {len(files)} files (byte-level, eod={BYTE_EOD}) -> {prefix}.bin/.idx", flush=True)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    tokens = 0
    start = last = time.perf_counter()
    for i, path in enumerate(files, 1):
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.uint16)
        if data.size == 0:
            continue
        document = np.append(data, np.uint16(BYTE_EOD))
        builder.add_document(document, [document.size])
        tokens += document.size
        now = time.perf_counter()
        if now - last >= progress_every or i == len(files):
            last = now
            rate = tokens / max(now - start, 1e-9) / 1e6
            print(f"  {i}/{len(files)} files | {tokens / 1e6:.2f} M tokens | {rate:.1f} M tokens/s", flush=True)
    builder.finalize(get_idx_path(prefix))
    return {"prefix": prefix, "documents": len(files), "tokens": tokens}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", nargs="+", help="text files or directories")
    source.add_argument("--python-stdlib", action="store_true", help="this interpreter's stdlib .py files")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_text_document.bin/.idx")
    parser.add_argument("--suffixes", nargs="+", default=[".txt", ".md", ".py", ".rst"],
                        help="file endings taken from --input directories")
    parser.add_argument("--limit-mb", type=float, default=8.0, help="--python-stdlib: at most this much text")
    parser.add_argument("--skip-existing", action="store_true", help="do nothing if the dataset exists")
    args = parser.parse_args(argv)

    prefix = args.output_prefix + "_text_document"
    if args.skip_existing and os.path.exists(prefix + ".idx") and os.path.exists(prefix + ".bin"):
        print(f"{prefix}.bin/.idx exist; skipping")
        return {"prefix": prefix, "skipped": True}
    files = stdlib_files(args.limit_mb) if args.python_stdlib else text_files(args.input, tuple(args.suffixes))
    if not files:
        raise SystemExit("error: no input files found")
    platform.setup()  # before megatron-core is imported (build)
    result = build(files, args.output_prefix)
    print(f"done: {result['documents']} documents, {result['tokens']} tokens", flush=True)
    return result


if __name__ == "__main__":
    main()
