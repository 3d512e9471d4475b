"""Chat data as megatron-core datasets, so megatron's builder, blends, --split, samplers and data
loaders serve it as they serve pretraining data (megatron/core/datasets/blended_megatron_dataset_builder.py).

    ChatLines             the low-level dataset: a JSON-lines file, each line's conversations encoded
                          (chat.py); --split divides it by lines
    PackedChatDataset     the mid-level dataset of one split: its conversations packed into rows
                          (packing.py). Sample i is a pure function of i: a resumed run's sampler,
                          positioned by consumed samples, reads exactly the rows an uninterrupted run reads.
"""
from __future__ import annotations

import os
import warnings
from collections import OrderedDict

import numpy as np
from megatron.core.datasets.megatron_dataset import MegatronDataset

from megatron_ext.seams.sft import chat_template
from megatron_ext.sft import chat, packing

_ENCODED: "OrderedDict[tuple, list]" = OrderedDict()  # parsed and encoded files (validation, then the build)
_KEEP = 4


class ChatLines:
    """A JSON-lines file of conversations, encoded: ``self[i]`` is line i's list of chat.Encoded."""

    def __init__(self, path: str, template: chat.ChatTemplate):
        self.path = path
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size, template.template,
               template.hf.name_or_path, len(template.hf), template.assistant_prefix_tokens)
        if key not in _ENCODED:
            _ENCODED[key] = [
                (number, [template.encode(c, number) for c in chat.split_conversations(messages)])
                for number, messages in chat.read_lines(path)
            ]
            while len(_ENCODED) > _KEEP:
                _ENCODED.popitem(last=False)
        _ENCODED.move_to_end(key)
        self.lines = _ENCODED[key]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> list:
        return self.lines[i][1]

    def line_number(self, i: int) -> int:
        return self.lines[i][0]


class PackedChatDataset(MegatronDataset):
    """One split's conversations packed into rows of config.sequence_length tokens. Rows are visited in
    a fresh order each epoch (a permutation drawn from --seed and the epoch), so a batch mixes the long
    conversations first-fit decreasing packs first with the short ones it packs last."""

    def __init__(self, dataset: ChatLines, dataset_path, indices, num_samples, index_split, config):
        with warnings.catch_warnings():
            # the base class warns where the pad token is another special token (EOS): GPT datasets mask
            # labels by that value; rows here mask by position (packing.assemble)
            warnings.filterwarnings("ignore", message="The pad token id in the tokenizer collides")
            super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)
        length = config.sequence_length
        encoded = [e for i in indices for e in dataset[int(i)]]
        kept = [packing.cut(e.ids, e.assistant, length) for e in encoded]
        self.conversations = [c for c in kept if c is not None]
        self.truncated = sum(len(e.ids) > length for e in encoded)  # cut to the row
        self.dropped = len(kept) - len(self.conversations)  # of those, no assistant token left
        self.rows = packing.first_fit_decreasing([len(ids) for ids, _ in self.conversations], length)
        self.filler = filler_id(config.tokenizer)
        self._order: tuple[int, np.ndarray] | None = None

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: ChatLines) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config) -> ChatLines:
        return ChatLines(dataset_path, chat.ChatTemplate(*chat_template(config.tokenizer)))

    def __len__(self) -> int:
        return len(self.rows) if self.num_samples is None else self.num_samples

    def _row_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.config.random_seed, self.index_split.value, epoch])
            self._order = (epoch, rng.permutation(len(self.rows)))
        return self._order[1]

    def __getitem__(self, idx: int) -> dict:
        epoch, position = divmod(int(idx), len(self.rows))
        row = self.rows[self._row_order(epoch)[position]]
        return packing.assemble([self.conversations[c] for c in row], self.config.sequence_length, self.filler)

    def summary(self) -> str:
        used = sum(len(self.conversations[c][0]) for row in self.rows for c in row)
        fill = used / max(1, len(self.rows) * self.config.sequence_length)
        return (f"{len(self.conversations)} conversations in {len(self.rows)} rows of {self.config.sequence_length} "
                f"tokens ({100 * fill:.1f}% filled), {self.truncated} cut to the row, {self.dropped} dropped "
                "(no assistant token left after the cut)")


def filler_id(tokenizer) -> int:
    """The id padding and unpredicted labels carry (out of the loss and of attention by position, so
    its value is immaterial): the pad token where there is one, else end-of-document, else 0."""
    for name in ("pad", "eod"):
        try:
            value = getattr(tokenizer, name)
        except (AttributeError, NotImplementedError):
            continue
        if isinstance(value, (int, np.integer)) and 0 <= value < tokenizer.vocab_size:
            return int(value)
    return 0
