"""Training, validation and test data as pretrain_gpt.py builds them: megatron-core GPT datasets
(indexed .bin/.idx, or mock) split by --split or given per split (--train/valid/test-data-path),
behind megatron's samplers and data loaders (--dataloader-type, --num-workers). A package that brings
its own data stands in for the GPT datasets through the same builder and loaders (features.py's
datasets hook: --sft's packed chat conversations, megatron_ext/sft).

The tokenizer comes from the tokenizer flags (megatron_ext/training/tokenizer.py); the byte-level
text of scripts/prepare_data.py (ids 0..255 = UTF-8 bytes, 256 = end of document) reads with
``--tokenizer-type NullTokenizer --vocab-size 257``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.training.datasets.data_samplers import build_pretraining_data_loader
from megatron.training.training import cyclic_iter
from megatron.training.utils.common_utils import get_blend_and_blend_per_split

from megatron_ext import platform
from megatron_ext.training import features, tokenizer

BYTE_VOCAB_SIZE = 257
BYTE_EOD = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; ``eod`` ends a document (scripts/prepare_data.py's default)."""

    vocab_size = BYTE_VOCAB_SIZE
    eod = BYTE_EOD

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    encode = tokenize

    def detokenize(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    decode = detokenize


def dataset_config(args) -> GPTDatasetConfig:
    """pretrain_gpt.py's core_gpt_dataset_config_from_args, for the options this loop supports."""
    blend, blend_per_split = (None, None) if args.mock_data else get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer.build(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def validate(args) -> None:
    """Every split's data, before any compute: after every package's checks (the tokenizer and the
    iteration count are settled), from megatron_ext/config/command_line.py finalize."""
    from megatron_ext.errors import ConfigError

    for flag, value in (("--full-validation", args.full_validation),
                        ("--multiple-validation-sets", args.multiple_validation_sets),
                        ("--dataloader-type=external", args.dataloader_type == "external"),
                        ("--fim-data", args.fim_data)):
        if value:
            raise ConfigError(f"{flag}: not supported by this loop (pretrain_gpt.py's standard GPT data only)")
    own = features.datasets(args)
    if own is not None:  # a package's own data (sft: every conversation rendered, masked and packed)
        own.check(args, dataset_config(args), list(num_samples(args)))
    elif not args.mock_data:
        _check_splits(dataset_config(args), list(num_samples(args)))
    import multiprocessing

    if args.num_workers > 0 and multiprocessing.current_process().daemon:
        raise ConfigError(
            f"--num-workers={args.num_workers}: this is a daemonic process, which cannot start data-loader "
            "worker processes; use --num-workers 0"
        )


def evaluating(args) -> bool:
    """Validation/test run when --eval-iters > 0 and --eval-interval is set (megatron sizes the
    validation set from --eval-interval: without it there is no evaluation)."""
    return bool(args.eval_iters) and args.eval_interval is not None


def num_samples(args) -> tuple[int, int, int]:
    """(train, valid, test) samples, megatron's get_train_valid_test_num_samples."""
    train = args.train_samples or args.train_iters * args.global_batch_size
    if not evaluating(args):
        return train, 0, 0
    points = (0 if args.skip_train else args.train_iters // args.eval_interval) + 1
    if args.start_eval_at_iter is not None and not args.skip_train:
        points = max(0, points - args.start_eval_at_iter // args.eval_interval)
    return train, points * args.eval_iters * args.eval_global_batch_size, args.eval_iters * args.eval_global_batch_size


def _check_splits(config: GPTDatasetConfig, sizes: list[int]) -> None:
    """A split that is asked for samples but holds no document makes megatron's GPTDataset loop
    forever (gpt_dataset.py _get_num_epochs); refuse it by name instead."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.errors import ConfigError

    if config.blend is None or config.split_matrix is None:
        return
    for prefix in config.blend[0]:
        if not os.path.exists(prefix + ".idx"):
            continue  # megatron names the missing file when it opens it
        documents = len(IndexedDataset(prefix, mmap=False).sequence_lengths)
        for name, bounds, wanted in zip(("train", "validation", "test"), config.split_matrix, sizes):
            if bounds is not None and wanted and round(bounds[0] * documents) == round(bounds[1] * documents):
                raise ConfigError(
                    f"--split={config.split}: the {name} split of {prefix} ({documents} documents) holds no "
                    f"document, but {wanted} {name} samples are needed"
                )


def build_datasets(args, sizes: list | None = None, read: tuple = (True, True, True)):
    """(train, valid, test) of `sizes` samples (default: the run's, num_samples); a split no iterator
    reads (`read` False) is None."""
    config, sizes = dataset_config(args), list(sizes or num_samples(args))
    _leave_out_unread(config, read)
    own = features.datasets(args)
    if own is not None:  # built by megatron's builder too; a split it builds all the same is not read
        return [d if r else None for d, r in zip(own.build(config, sizes), read)]
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    _check_splits(config, sizes)
    if not config.mock:
        return BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, config).build()
    key = (dataset_cls, tuple(sizes), _described(config))
    if key not in _MOCK_BUILT:
        _MOCK_BUILT.clear()
        _MOCK_BUILT[key] = BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, config).build()
    return _MOCK_BUILT[key]


# The mock datasets last built in this process, by everything that decides their samples. They read no
# file, so the same description always gives the same samples; a process that starts runs again (a test
# worker, the planner's candidates) builds their million-sample indices once, not once per run.
_MOCK_BUILT: dict = {}


def _described(config: GPTDatasetConfig) -> str:
    from dataclasses import fields

    tok = config.tokenizer
    own = [(f.name, getattr(config, f.name, None)) for f in fields(config) if f.name != "tokenizer"]
    kind = [type(tok).__qualname__] + [repr(getattr(tok, a, None)) for a in ("unique_identifiers", "vocab_size", "eod")]
    return repr((own, kind))


def _leave_out_unread(config: GPTDatasetConfig, read: tuple) -> None:
    """Megatron builds every split the --split ratios name, read or not: each a whole epoch of sample
    and shuffle indices (the mock data's: a million samples, ~0.25 s a split and rank). A split no
    iterator reads is marked as megatron marks a split of ratio 0 (None); the others' document
    ranges, and so their samples, are unchanged."""
    if config.blend_per_split is not None:
        config.blend_per_split = [b if r else None for b, r in zip(config.blend_per_split, read)]
    elif config.split_matrix is not None:
        config.split_matrix = [m if r else None for m, r in zip(config.split_matrix, read)]


def consumed_valid_samples(args, iteration: int) -> int:
    """Validation samples the evaluations up to `iteration` read (megatron's resume arithmetic)."""
    if not evaluating(args):
        return 0
    start = args.start_eval_at_iter or 0
    return max(0, iteration // args.eval_interval - start // args.eval_interval) * args.eval_iters * args.eval_global_batch_size


@dataclass
class Iterators:
    train: list  # one iterator per model chunk (each virtual stage consumes every micro-batch)
    valid: list | None
    test: list | None


def _iterators(args, dataset, consumed: int, num_chunks: int) -> list | None:
    if dataset is None:
        return None
    from megatron_ext.seams import megatron_training_globals

    out = []
    with megatron_training_globals(args):
        for _ in range(num_chunks):
            loader = build_pretraining_data_loader(dataset, consumed)
            loader.pin_memory = loader.pin_memory and platform.current().is_cuda  # no pinning thread on CPU
            out.append(iter(cyclic_iter(loader)) if args.dataloader_type == "cyclic" else iter(loader))
    return out


def build_iterators(args, num_chunks: int, iteration: int = 0) -> Iterators:
    """Positioned after `iteration` iterations, so a resumed run reads exactly the data (training
    and validation) an uninterrupted one would."""
    held_out = evaluating(args)
    train, valid, test = build_datasets(args, read=(True, held_out, held_out))
    return Iterators(
        train=_iterators(args, train, iteration * args.global_batch_size, num_chunks),
        valid=_iterators(args, valid, consumed_valid_samples(args, iteration), num_chunks),
        test=_iterators(args, test, 0, num_chunks),
    )


def build_train_iterators(args, num_chunks: int, consumed_samples: int = 0) -> list:
    """The training iterators alone (benchmarks and schedule tests)."""
    train = build_datasets(args, [args.train_samples or args.train_iters * args.global_batch_size, 0, 0],
                           read=(True, False, False))[0]
    return _iterators(args, train, consumed_samples, num_chunks)
