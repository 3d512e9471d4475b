"""Training data: megatron-core GPT datasets (indexed .bin/.idx or mock) behind Megatron's sampler.

Text is byte-level: ids 0..255 are UTF-8 bytes and 256 is end-of-document, so the tokenizer needs no
download. Training uses megatron-core's NullTokenizer with ``--vocab-size 257`` (eod = vocab_size-1).
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

BYTE_VOCAB_SIZE = 257
BYTE_EOD = 256


class ByteTokenizer:
    """UTF-8 bytes as token ids; ``eod`` ends a document."""

    vocab_size = BYTE_VOCAB_SIZE
    eod = BYTE_EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenizer(args):
    return NullTokenizer(vocab_size=args.vocab_size)


def padded_vocab_size(args) -> int:
    """As megatron.training's tokenizer builder pads it: a multiple of divisible_by x TP."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-args.vocab_size // multiple) * multiple


def dataset_config(args) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else _blend(args),
        split=args.split,
        tokenizer=tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        path_to_cache=args.data_cache_path,
    )


def _blend(args):
    """--data-path PREFIX, or --data-path W1 PREFIX1 W2 PREFIX2 ... (Megatron's format)."""
    if len(args.data_path) == 1:
        return args.data_path, None
    weights, prefixes = args.data_path[0::2], args.data_path[1::2]
    return prefixes, [float(w) for w in weights]


def build_train_dataset(args):
    samples = args.train_iters * args.global_batch_size
    dataset_cls = MockGPTDataset if args.mock_data else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        dataset_cls, [samples, 0, 0], lambda: True, dataset_config(args)
    ).build()
    return train


def build_train_iterators(args, num_chunks: int, consumed_samples: int = 0) -> list:
    """One iterator per model chunk (each virtual stage consumes every micro-batch), positioned
    after `consumed_samples` so a resumed run sees exactly the data an uninterrupted one would."""
    dataset = build_train_dataset(args)
    iterators = []
    for _ in range(num_chunks):
        sampler = MegatronPretrainingSampler(
            total_samples=len(dataset),
            consumed_samples=consumed_samples,
            micro_batch_size=args.micro_batch_size,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=parallel_state.get_data_parallel_world_size(),
        )
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)
        iterators.append(iter(loader))
    return iterators
