"""LoRA adapters on megatron-core's tensor-parallel linears, exact under every layout.

An adapted linear computes ``base(x) + scale * B(A(dropout(x)))`` (peft's LoRA; scale = alpha / r, or
alpha / sqrt(r) with --lora-rslora). The adapter lives on the linear as its child ``lora`` (a
``LinearAdapter``) holding one (A, B) pair per *part*:

  part   rows of the linear's output it adapts
  q k v  the query, key, value rows of linear_qkv (megatron interleaves them by GQA group: for each
         group its query heads, its key head, its value head; the pairs' B rows are the heads in order)
  gate   the first half of a gated linear unit's linear_fc1 (megatron's [gate; up]), up the second
  all    every row (linear_proj, linear_fc2, a non-gated linear_fc1, multi-latent attention's
         projections, the router, and any linear in the fused form, --lora-fused-adapters)

so the parameters are ``<linear>.lora.<part>.lora_A.weight`` ([r, in]) and ``.lora_B.weight`` ([out, r]),
global shapes as a single process holds them.

Tensor parallelism (the linear's own group: the tensor-parallel group, the expert-TP group for
experts), with megatron-core's mappings so the gradients are right:

* column-parallel base (its output sharded): A replicated, B sharded like the output. ``h = x A^T`` is
  r wide; without sequence parallelism ``copy_to`` (identity forward, all-reduce of dh backward: every
  rank's B shard contributes to dh); with it, ``h`` of this rank's sequence shard is all-gathered
  (reduce-scattered backward) and A's gradient, which covers only the local sequence shard, is marked
  ``sequence_parallel`` for megatron's finalize_model_grads to sum over the group, as it sums the norms'.
* row-parallel base (its input sharded): A sharded like the input, B replicated. ``h`` is a partial sum
  over the group, reduced as the base's output is (all-reduce, or reduce-scatter under sequence
  parallelism, where B is marked ``sequence_parallel``); the B term is added after the base's reduction.
* explicit communication (experts, and a shared expert under --moe-shared-expert-overlap: megatron's
  ``explicit_expert_comm``): the token dispatcher gathers the input and reduces the output around the
  linear, so the linear's input is the same on every rank of the group and its output a partial sum.
  A column adapter's ``h`` is then whole on every rank but its gradient a partial sum; a row adapter's
  B term is a partial sum that the dispatcher's reduction completes. The replicated factor goes through
  ``copy_to`` itself (identity forward, all-reduce of its gradient backward), since finalize_model_grads
  sums ``sequence_parallel`` gradients over the dense tensor-parallel group only.

Every product is megatron's own ``linear_with_grad_accumulation_and_async_allreduce`` (forward
``x W^T``, input gradient ``dy W``, weight gradient ``dy^T x``), the products the zero-sync grouped
experts (megatron_ext/moe/grouped_experts.py) reproduce bit for bit: ``grouped_delta`` runs the same
adapter term there as grouped GEMMs.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

ROW_KEY = "lora_A"
COL_KEY = "lora_B"


@dataclass(frozen=True)
class Spec:
    parallel: str  # "column", "row" or "replicated" (the router)
    parts: tuple  # ((name, local output rows), ...)
    in_local: int  # input features on this rank (row-parallel: the shard)
    rank: int
    scale: float
    dropout: float
    layout: str  # "single", "qkv" or "glu"
    qkv: tuple = ()  # (query groups on this rank, query heads per group, head dim) for layout "qkv"
    glu_fused: bool = False  # one pair over a GLU linear_fc1: B sharded as megatron shards [gate; up]
    expert: bool = False


class Factor(torch.nn.Module):
    """One factor of a pair: a ``weight`` parameter, named as peft names its factors (lora_A.weight)."""

    def __init__(self, rows: int, cols: int, dtype, device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(rows, cols, dtype=dtype, device=device))


class Pair(torch.nn.Module):
    def __init__(self, a_shape, b_shape, dtype, device):
        super().__init__()
        self.lora_A = Factor(*a_shape, dtype, device)
        self.lora_B = Factor(*b_shape, dtype, device)


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` as megatron's local linear computes it, forward and backward (no communication)."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    return linear_with_grad_accumulation_and_async_allreduce(
        x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)


class LinearAdapter(torch.nn.Module):
    """The LoRA pairs of one linear (its child ``lora``) and the term they add to its output."""

    def __init__(self, spec: Spec, dtype, device):
        super().__init__()
        self.spec = spec
        for name, rows in spec.parts:
            a_cols = spec.in_local
            self.add_module(name, Pair((spec.rank, a_cols), (rows, spec.rank), dtype, device))

    def pairs(self) -> list:
        return [getattr(self, name) for name, _ in self.spec.parts]

    # ---- the forward term ------------------------------------------------------------------
    def _comm(self, linear):
        """(group, its size, sequence parallel, explicit communication) of the adapted linear."""
        if self.spec.parallel == "replicated":
            return None, 1, False, False
        group = linear.tp_group
        size = group.size()
        explicit = bool(getattr(linear, "explicit_expert_comm", False))
        return group, size, bool(linear.sequence_parallel) and size > 1 and not explicit, explicit

    def _a(self, linear) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        pairs = self.pairs()
        a = pairs[0].lora_A.weight if len(pairs) == 1 else torch.cat([p.lora_A.weight for p in pairs])
        group, size, _, explicit = self._comm(linear)
        if self.spec.parallel == "column" and explicit and size > 1:
            a = mappings.copy_to_tensor_model_parallel_region(a, group=group)  # all-reduce of dA
        return a

    def _b(self, linear, i: int) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        b = self.pairs()[i].lora_B.weight
        group, size, _, explicit = self._comm(linear)
        if self.spec.parallel == "row" and explicit and size > 1:
            b = mappings.copy_to_tensor_model_parallel_region(b, group=group)  # all-reduce of dB
        return b

    def _split(self, h: torch.Tensor) -> list:
        r = self.spec.rank
        if len(self.spec.parts) == 1:
            return [h]
        return [piece.contiguous() for piece in torch.split(h, r, dim=-1)]

    def _combine(self, deltas: list) -> torch.Tensor:
        if self.spec.layout == "single":
            return deltas[0]
        if self.spec.layout == "glu":
            return torch.cat(deltas, dim=-1)
        groups, per_group, d = self.spec.qkv  # q: [.., groups*per_group*d], k and v: [.., groups*d]
        q, k, v = deltas
        lead = q.shape[:-1]
        mixed = torch.cat([q.reshape(*lead, groups, per_group * d), k.reshape(*lead, groups, d),
                           v.reshape(*lead, groups, d)], dim=-1)
        return mixed.reshape(*lead, groups * (per_group + 2) * d)

    def weight_delta(self) -> torch.Tensor:
        """scale * B @ A in fp32, laid out as the adapted linear's local weight rows [out, in]."""
        deltas = [(pair.lora_B.weight.float() @ pair.lora_A.weight.float()).t() for pair in self.pairs()]
        return self._combine(deltas).t() * self.spec.scale

    def _dropout(self, linear, x: torch.Tensor, replicated: bool) -> torch.Tensor:
        """peft's dropout on the adapter's input. An input that is the same on every rank of the
        linear's group draws from the default generator (the same stream on every such rank); a
        sharded one from megatron's model-parallel tracker (the expert tracker for experts), as
        megatron's own dropout in those regions does."""
        p = self.spec.dropout
        if not p or not self.training:
            return x
        if replicated:
            return torch.nn.functional.dropout(x, p, training=True)
        from megatron.core import tensor_parallel
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        tracker = tensor_parallel.get_cuda_rng_tracker()
        name = get_expert_parallel_rng_tracker_name() if self.spec.expert else None
        with tracker.fork(name) if name else tracker.fork():
            return torch.nn.functional.dropout(x, p, training=True)

    def delta(self, linear, x: torch.Tensor) -> torch.Tensor:
        """``scale * B(A(dropout(x)))`` shaped like the linear's output on this rank (before the base's
        reduction for an explicit-communication linear, after it otherwise)."""
        from megatron.core.tensor_parallel import mappings

        group, size, sp, explicit = self._comm(linear)
        spec = self.spec
        if spec.parallel == "row":
            x = self._dropout(linear, x, replicated=size == 1)
            h = _product(x, self._a(linear))
            if not explicit and size > 1:
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if sp
                     else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
            d = _product(h, self._b(linear, 0))
        else:
            x = self._dropout(linear, x, replicated=not sp)
            h = _product(x, self._a(linear))
            if spec.parallel == "column" and not explicit and size > 1:
                h = (mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
                     if sp else mappings.copy_to_tensor_model_parallel_region(h, group=group))
            d = self._combine([_product(hp, self._b(linear, i)) for i, hp in enumerate(self._split(h))])
        return d * spec.scale

    def grouped_delta(self, x: torch.Tensor, offsets: torch.Tensor, linears: list, grouped_matmul):
        """The same term for every local expert at once (``linears``: the experts' linear, in order;
        ``x``: their rows, contiguous per expert): the products as ``grouped_matmul(x, offsets,
        *per-expert weights)`` (megatron_ext.moe.grouped_experts), which computes each expert's rows
        as ``_product`` does. Dropout is refused with the grouped experts (its draws follow the
        buffer's size, not the experts')."""
        assert not self.spec.dropout or not self.training
        adapters = [lin.lora for lin in linears]
        _, size, _, explicit = self._comm(linears[0])
        assert explicit or size == 1  # experts: the dispatcher communicates, never the adapter
        h = grouped_matmul(x, offsets, *[ad._a(lin) for ad, lin in zip(adapters, linears)])
        pieces = self._split(h)
        deltas = [grouped_matmul(hp, offsets, *[ad._b(lin, i) for ad, lin in zip(adapters, linears)])
                  for i, hp in enumerate(pieces)]
        return self._combine(deltas) * self.spec.scale

    # ---- checkpoint entries ----------------------------------------------------------------
    def checkpoint_entries(self, linear, prefix: str, sharded_offsets, metadata) -> dict:
        """The pairs' entries, keyed ``<prefix>lora.<part>.lora_A.weight`` ..., sharded as the factors
        are: a column adapter's B on axis 0 like the base's weight (a fused GLU B as megatron shards
        [gate; up]), a row adapter's A on axis 1; the replicated factors replicated over the group."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tensors, axes = {}, {}
        for name, _ in self.spec.parts:
            pair = getattr(self, name)
            a, b = f"lora.{name}.lora_A.weight", f"lora.{name}.lora_B.weight"
            tensors[a], tensors[b] = pair.lora_A.weight, pair.lora_B.weight
            if self.spec.parallel == "column":
                axes[b] = 0
            elif self.spec.parallel == "row":
                axes[a] = 1
        group = getattr(linear, "tp_group", None)
        if group is None:  # the router: replicated over the tensor-parallel group
            from megatron.core import parallel_state

            group = parallel_state.get_tensor_model_parallel_group()
        out = make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets, tp_group=group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        if self.spec.glu_fused:
            key = f"{prefix}lora.all.lora_B.weight"
            out[key] = apply_swiglu_sharded_factory(
                out[key], sharded_offsets, metadata.get("singleton_local_shards", False), tp_group=group,
                dp_group=metadata["dp_cp_group"])
        return out


# ---------------------------------------------------------------------------------------------
# initialisation: independent of the layout
# ---------------------------------------------------------------------------------------------
def _rows(key: str, global_shape, first: int, count: int, seed: int) -> torch.Tensor:
    """Rows ``first .. first+count`` (axis 0) of the global A named ``key``: peft's kaiming-uniform
    (a = sqrt(5): uniform in +-1/sqrt(fan in)), row i drawn from a generator seeded by (seed, key, i)
    only, so any layout's shard holds the same values."""
    bound = 1.0 / math.sqrt(global_shape[-1])
    base = seed * 1_000_003 + zlib.crc32(key.encode())
    rows = []
    for i in range(first, first + count):
        g = torch.Generator().manual_seed(base + i)
        rows.append(torch.rand(tuple(global_shape[1:]), generator=g, dtype=torch.float64) * (2 * bound) - bound)
    return torch.stack(rows)


@torch.no_grad()
def init_adapters(model_chunks: list, seed: int) -> int:
    """Every adapter's A from its global checkpoint key and ``seed`` (this rank's shard of the full
    tensor), B zeros. Returns how many factors were set."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.seams import unwrapped

    count = 0
    for chunk in model_chunks:
        for sh in _adapter_tensors(unwrapped(chunk).sharded_state_dict()):
            if not isinstance(sh, ShardedTensor):
                continue
            if sh.key.endswith(f"{COL_KEY}.weight"):
                sh.data.zero_()
            else:
                axis0 = sh.global_offset[0]
                length0 = 1 if sh.prepend_axis_num > 0 else sh.data.shape[0]
                full = _rows(sh.key, sh.global_shape, axis0, length0, seed)
                index = [slice(None)]
                for axis in range(1, len(sh.global_shape)):
                    local = axis - sh.prepend_axis_num
                    length = 1 if local < 0 else sh.data.shape[local]
                    index.append(slice(sh.global_offset[axis], sh.global_offset[axis] + length))
                sh.data.copy_(full[tuple(index)].reshape(sh.data.shape).to(sh.data.dtype))
            count += 1
    return count


def _adapter_tensors(state):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            if is_adapter_key(value.key):
                yield value
        elif isinstance(value, ShardedTensorFactory):
            if is_adapter_key(value.key):
                built = value.build()
                yield from (t for t in (built if isinstance(built, list) else [built]))
        elif isinstance(value, dict):
            yield from _adapter_tensors(value)


def is_adapter_key(key: str) -> bool:
    """A parameter or checkpoint key of an adapter factor."""
    return ".lora." in f".{key}" and (key.endswith(f"{ROW_KEY}.weight") or key.endswith(f"{COL_KEY}.weight"))
