"""Conversations packed into rows of --seq-length tokens.

First-fit decreasing across every conversation of a split (not one row per JSON line, as Megatron-LM
packs): the longest first, each into the first row with room, so rows are full and few. A conversation
longer than a row is cut to --seq-length tokens on the right (as Megatron-LM cuts a pack); one that
keeps no assistant token after the cut is dropped. The rest of a row is padding.

A row, as the data loader hands it to the step (megatron's SFTDataset keys):

    tokens, labels     int64 [S]; labels[t] = tokens[t + 1] inside a conversation
    loss_mask          float32 [S]; 1 where labels[t] is an assistant token. The last token of a
                       conversation predicts nothing (its next token belongs to another conversation),
                       and padding predicts nothing
    position_ids       int64 [S], restarting at 0 at each conversation (and at the padding)
    cu_seqlens         int32 [S + 1]: 0, each conversation's end, S (the padding ends the row as a
                       segment of its own), then S repeated so rows collate (megatron's layout)
    max_seqlen         int32 []: the longest segment
"""
from __future__ import annotations

import numpy as np
import torch


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (lists of indices into `lengths`, each summing to at most `capacity`): longest first, each
    into the leftmost row with room. A max-tree over the rows' free space finds that row in log time."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    free = [capacity] * (2 * size)  # unopened rows have all their room; rows open left to right
    rows: list[list[int]] = []
    for i in order:
        need = lengths[i]
        if need > capacity:
            raise ValueError(f"a conversation of {need} tokens does not fit a row of {capacity}")
        node = 1
        while node < size:  # the leftmost leaf with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def cut(ids: np.ndarray, assistant: np.ndarray, capacity: int):
    """The conversation cut to `capacity` tokens, or None when no assistant token is predicted in it."""
    ids, assistant = ids[:capacity], assistant[:capacity]
    return (ids, assistant) if assistant[1:].any() else None


def assemble(conversations: list, seq_length: int, filler: int) -> dict:
    """One row from (ids, assistant) pairs whose lengths sum to at most seq_length."""
    tokens = np.full(seq_length, filler, dtype=np.int64)
    labels = np.full(seq_length, filler, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    position_ids = np.zeros(seq_length, dtype=np.int64)
    ends, start = [0], 0
    for ids, assistant in conversations:
        n = len(ids)
        tokens[start:start + n] = ids
        labels[start:start + n - 1] = ids[1:]
        loss_mask[start:start + n - 1] = assistant[1:]
        position_ids[start:start + n] = np.arange(n)
        start += n
        ends.append(start)
    if start < seq_length:  # the padding: a segment of its own, out of the loss
        position_ids[start:] = np.arange(seq_length - start)
        ends.append(seq_length)
    cu_seqlens = np.full(seq_length + 1, seq_length, dtype=np.int32)
    cu_seqlens[:len(ends)] = ends
    return {
        "tokens": torch.from_numpy(tokens),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
        "cu_seqlens": torch.from_numpy(cu_seqlens),
        "max_seqlen": torch.tensor(int(np.diff(ends).max()), dtype=torch.int32),
    }
