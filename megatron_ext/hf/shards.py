"""Which part of each megatron tensor this rank holds, and the Hugging Face reads that fill it.

The part comes from megatron-core itself: the model's ``sharded_state_dict`` (the one a save writes)
describes every local tensor as a piece of a global one, by offset. That is where megatron's own
partitioning lives: vocabulary rows per TP rank, the q/k/v rows of each TP rank's query groups,
gate and up halves of a GLU fc1 each sharded per TP rank (megatron-core's swiglu factory), a
row-parallel linear's columns, experts per EP rank (a leading expert axis), layers per pipeline and
virtual stage (the global layer number in the key). A rank fills each piece from the slices of the
HF tensors it covers (safetensors' lazy ``get_slice``), so it reads only what it holds, and
dist_checkpointing saves the same checkpoint a one-process import saves.

A family-table row's megatron tensor is, along its first dimension, a concatenation of row ranges of
its HF tensors (:func:`segments`): ``copy`` one tensor, ``glu`` gate then up, ``qkv`` for each query
group its query heads, its key head, its value head. A stacked row (gpt-oss, Llama-4) holds every
expert in one HF tensor; a piece of expert E reads that expert's entry and transforms it.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from megatron_ext.checkpoint import sharded_tensors
from megatron_ext.errors import ConfigError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"


@dataclasses.dataclass
class Piece:
    """One rank's part of a global megatron tensor."""

    name: str                 # the global name, as the family tables write it (global layer and expert)
    shape: tuple              # the global tensor's shape
    slices: tuple             # the part of it this piece holds, one slice per dimension
    dest: torch.Tensor        # where it lives on this rank (a view of the tensor below)
    whole: torch.Tensor       # the local parameter or buffer it is part of
    main: bool                # the main replica (the one copy a save writes)


def _global_name(local: str, sh) -> str:
    """The table name of a local tensor. Its layer is global across pipeline and virtual stages:
    the number in the sharded key where megatron keys layers one by one (a block of unlike layers),
    else the offset on the leading layer axis it stacks them on; its expert is the offset on the
    (next) expert axis. A tied output layer on the last stage is the embedding (megatron keys it so)."""
    if sh.key == _EMBEDDING:
        return _EMBEDDING
    axes = list(sh.global_offset[:sh.prepend_axis_num])
    name = local
    if _LAYER.match(local):
        layer = _LAYER.match(sh.key)
        name = _LAYER.sub(f"decoder.layers.{layer.group(1) if layer else axes.pop(0)}.", local)
    if _EXPERT.search(name):
        name = _EXPERT.sub(f".local_experts.{axes.pop(0)}.", name)
    return name


def _is_main(replica_id) -> bool:
    return all(r == 0 for r in replica_id) if isinstance(replica_id, tuple) else replica_id == 0


def pieces(chunks, metadata: dict) -> list[Piece]:
    """Every piece of this rank's model chunks, described by the sharded state dict a save writes
    (`metadata` as the save passes it)."""
    from megatron_ext.seams import unwrapped

    out = []
    for chunk in chunks:
        module = unwrapped(chunk)
        held = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
        for local, entry in module.sharded_state_dict(metadata=metadata).items():
            if local not in held or "_extra_state" in local:
                continue
            storage = held[local].untyped_storage().data_ptr()
            for sh in sharded_tensors({local: entry}):
                if sh.flattened_range is not None:  # a distributed optimizer's flat shard: never here
                    raise ConfigError(f"{local}: a flattened checkpoint shard cannot be filled from Hugging Face "
                                      "tensors")
                if sh.data.untyped_storage().data_ptr() != storage:
                    raise ConfigError(f"{local}: its sharded state is a copy of the parameter, not a view of it")
                n = sh.prepend_axis_num
                offsets, shape = sh.global_offset[n:], tuple(sh.global_shape[n:])
                slices = tuple(slice(o, o + s) for o, s in zip(offsets, sh.local_shape))
                out.append(Piece(_global_name(local, sh), shape, slices, sh.data, held[local], _is_main(sh.replica_id)))
    return out


class Prebuilt:
    """A model chunk as the Checkpointer saves or loads it, with megatron-core's sharded-tensor
    factories built beforehand. A GLU fc1 is one parameter that the swiglu factory splits into its
    gate and up halves, two views: megatron-core's writer clones every view before it writes
    (filesystem_async.py, _clone_or_dequantize_if_needed), all at once, and a load concatenates
    the halves into new tensors (the factory's merge) before they are copied into the model. Either
    way every fc1 is held twice at the peak: about half the weights of a dense model more.

    own_storage (a save that is the model's last use, an import's): each half is moved into a
    tensor of its own and the parameter's memory freed, one fc1 at a time. Otherwise (a load) the
    halves stay views into the parameters, which dist_checkpointing reads into in place, and there
    is nothing left to copy: load_state_dict does nothing."""

    def __init__(self, chunk, metadata: dict, own_storage: bool):
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        from megatron_ext.seams import unwrapped

        self._chunk = unwrapped(chunk)
        self._state = self._chunk.sharded_state_dict(metadata=metadata)
        for key, entry in self._state.items():
            if isinstance(entry, ShardedTensorFactory):
                built = list(sharded_tensors({key: entry}))
                if own_storage:
                    for sh in built:
                        sh.data = sh.data.clone()
                    entry.data.untyped_storage().resize_(0)
                self._state[key] = built

    def sharded_state_dict(self, metadata=None) -> dict:
        return self._state

    def load_state_dict(self, state, strict=True) -> None:
        """Nothing to copy: the load wrote into the parameters (views of them)."""

    def state_dict(self, keep_vars=False) -> dict:
        return self._chunk.state_dict(keep_vars=keep_vars)

    def named_parameters(self):
        return self._chunk.named_parameters()


# ---------------------------------------------------------------------------------------------
# a row's megatron tensor as row ranges of its HF tensors
# ---------------------------------------------------------------------------------------------
def segments(kind: str, shapes: list, head_dim: int) -> list[tuple[int, int, int]]:
    """The first dimension of a (non-stacked) row's megatron tensor, in order: (HF tensor index,
    first row, end row) of each part."""
    if kind == "copy":
        return [(0, 0, shapes[0][0])]
    if kind == "glu":  # megatron's --swiglu gates the first half
        return [(0, 0, shapes[0][0]), (1, 0, shapes[1][0])]
    if kind == "qkv":  # by GQA group: its query heads, its key head, its value head
        groups = shapes[1][0] // head_dim
        per_group = shapes[0][0] // groups
        out = []
        for g in range(groups):
            out += [(0, g * per_group, (g + 1) * per_group), (1, g * head_dim, (g + 1) * head_dim),
                    (2, g * head_dim, (g + 1) * head_dim)]
        return out
    raise AssertionError(kind)


def join(kind: str, parts: list, head_dim: int) -> torch.Tensor:
    """A row's megatron tensor from its HF tensors."""
    if kind == "copy":
        return parts[0]
    return torch.cat([parts[i][a:b] for i, a, b in segments(kind, [p.shape for p in parts], head_dim)])


def split(kind: str, t: torch.Tensor, hf_shapes: list, head_dim: int) -> list:
    """A row's HF tensors from its megatron tensor (the inverse of join)."""
    if kind == "copy":
        return [t]
    pieces_of = [[] for _ in hf_shapes]
    offset = 0
    for i, a, b in segments(kind, hf_shapes, head_dim):
        pieces_of[i].append(t[offset:offset + b - a])
        offset += b - a
    return [torch.cat(p) for p in pieces_of]


def reads(kind: str, shapes: list, head_dim: int, piece: Piece) -> list[tuple[int, tuple, tuple]]:
    """The reads that fill `piece` of a non-stacked row: (HF tensor index, its slices, the piece's
    destination slices), one per part of the row the piece's first-dimension range meets."""
    if not piece.shape:  # a scalar
        return [(0, (), ())]
    first, rest = piece.slices[0], piece.slices[1:]
    out, offset = [], 0
    for i, a, b in segments(kind, shapes, head_dim):
        lo, hi = max(first.start, offset), min(first.stop, offset + b - a)
        if lo < hi:
            out.append((i, (slice(a + lo - offset, a + hi - offset), *rest),
                        (slice(lo - first.start, hi - first.start),) + (slice(None),) * len(rest)))
        offset += b - a
    return out
