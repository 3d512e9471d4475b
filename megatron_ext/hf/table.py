"""A family's weight table (weight_tables.py) filled in for one model, and its transforms between the two sides.

A row is (megatron names, HF names, transform): one megatron name, or for a stacked row one per expert
(gpt-oss, Llama-4 hold a layer's experts in one HF tensor). ``to_megatron`` and ``to_hf`` are each
other's inverse; ``shards.py`` reads a rank's part of a row straight from the HF files."""
from __future__ import annotations

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import shards, weight_tables
from megatron_ext.hf.config_json import Config


def rows(model_type: str, c: Config):
    """The family's table with {L} and {E} filled in for every layer and expert of the config."""
    layers = c["num_hidden_layers"]
    experts = c.raw.get("num_experts") or c.raw.get("num_local_experts") or c.raw.get("n_routed_experts") or 0
    for mg, hf, kind in weight_tables.TABLES[model_type]:
        stacked = kind.startswith("stacked")
        for layer in range(layers) if "{L}" in mg else [None]:
            for expert in range(experts) if "{E}" in mg and not stacked else [None]:
                def fill(s, e=expert):
                    return s.replace("{L}", str(layer)).replace("{E}", str(e))
                yield (tuple(fill(mg, e) for e in range(experts)) if stacked else (fill(mg),)), [fill(h) for h in hf], kind


def expand(model_type: str, c: Config, names) -> list[tuple[tuple[str, ...], list[str], str]]:
    """The table's rows kept where the model has the megatron names; every name covered."""
    kept = [row for row in rows(model_type, c) if all(m in names for m in row[0])]
    covered = {m for r in kept for m in r[0]}
    uncovered = sorted(n for n in names if n not in covered)
    if uncovered:
        raise ConfigError(f"the {model_type} table maps no HF tensor to {uncovered[0]} (the recipe builds a model "
                          "this family's table does not describe)")
    return kept


def head_dim(c: Config) -> int:
    return c.raw.get("head_dim") or c.raw["hidden_size"] // c.raw["num_attention_heads"]


def _interleaved(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate (even) and up (odd) of an interleaved last dimension."""
    return t[..., ::2], t[..., 1::2]


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.stack([gate, up], -1).flatten(-2)


def to_megatron(kind: str, parts: list[torch.Tensor], c: Config) -> list[torch.Tensor]:
    """One row's HF tensors -> its megatron tensors (one per megatron name)."""
    if not kind.startswith("stacked"):
        return [shards.join(kind, parts, head_dim(c))]
    (t,) = parts
    if kind == "stacked_glu_t":  # [E, h, 2f] -> [2f, h] each
        return [torch.cat(_interleaved(e), -1).t() for e in t]
    if kind == "stacked_glu":  # [E, 2f] -> [2f] each
        return [torch.cat(_interleaved(e), -1) for e in t]
    if kind == "stacked_t":  # [E, f, h] -> [h, f] each
        return [e.t() for e in t]
    assert kind == "stacked", kind
    return list(t)


def to_hf(kind: str, ts: list[torch.Tensor], c: Config, shapes: list) -> list[torch.Tensor]:
    """One row's megatron tensors -> its HF tensors of ``shapes`` (the inverse of to_megatron)."""
    if not kind.startswith("stacked"):
        return shards.split(kind, ts[0], shapes, head_dim(c))
    if kind == "stacked_glu_t":
        return [torch.stack([_interleave(*t.t().chunk(2, -1)) for t in ts])]
    if kind == "stacked_glu":
        return [torch.stack([_interleave(*t.chunk(2, -1)) for t in ts])]
    if kind == "stacked_t":
        return [torch.stack([t.t() for t in ts])]
    assert kind == "stacked", kind
    return [torch.stack(ts)]


def hf_shapes(kind: str, mg_shapes: list, c: Config) -> list[tuple]:
    """The HF tensors' shapes of a row whose megatron tensors have `mg_shapes`."""
    d = head_dim(c)
    if kind == "copy":
        return [tuple(mg_shapes[0])]
    if kind == "glu":
        return [(mg_shapes[0][0] // 2, *mg_shapes[0][1:])] * 2
    if kind == "qkv":
        heads, groups = c.raw["num_attention_heads"], c.raw.get("num_key_value_heads") or c.raw["num_attention_heads"]
        return [(heads * d, *mg_shapes[0][1:]), (groups * d, *mg_shapes[0][1:]), (groups * d, *mg_shapes[0][1:])]
    meta = to_hf(kind, [torch.empty(s, device="meta") for s in mg_shapes], c, [])
    return [tuple(t.shape) for t in meta]


def converted_to_hf(kind: str, ts: list[torch.Tensor], c: Config) -> list[torch.Tensor]:
    """One row's megatron tensors as its HF tensors (their shapes from the row's)."""
    return to_hf(kind, ts, c, hf_shapes(kind, [t.shape for t in ts], c))
