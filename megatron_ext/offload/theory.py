"""What offload saves, from the model's shapes and the schedule alone (no measurement), and what
stays on the device by design.

**Group bytes** (``group_bytes``): what one layer's chosen modules save for backward per
micro-batch, one function per module (``MODULE_BYTES``), each taking the attention kind. The shapes
are the local layer spec as the tests, the benchmark and scripts/gpu_check.py build it: multi-head
attention (no GQA, no rotary: q/k/v stay views of the fused QKV output), no attention dropout,
non-gated GELU experts and dense MLPs (SequentialMLP, probabilities applied after the activation),
dropless routing with TP=EP=1. Attention kinds (``ATTENTION``): ``unfused``, megatron's
DotProductAttention (baddbmm, masked softmax, bmm), which keeps the [b, heads, s, s] probabilities
(in fp32 too when the softmax runs in fp32 on 16-bit inputs, as megatron's
``attention_softmax_in_fp32`` default does under --bf16); ``sdpa``, torch's
scaled_dot_product_attention (megatron_ext.attention.kernels), which keeps the fused QKV output and
the fp32 log-sum-exp per head and query (mbs x heads x s): O(s x hidden), no s x s term. It keeps its output too, which is linear_proj's input, one storage: it moves with
core_attention and attn_proj offloaded together (it is attn_proj's bytes), and attn_proj alone moves
nothing (core attention still holds that storage).
Under context parallelism (``cp`` > 1, torch attention only: megatron_ext.attention.context_parallel)
every count is at the rank's tokens (seq x mbs / cp), and core attention keeps what its comm type
(``cp_comm_type``) hands the kernel: ``all_gather`` the fused QKV output (the local queries are a view of
it), the gathered keys and values (cp x the local ones) and its two chunks' outputs and log-sum-exps
(a causal layer without a mask runs a kernel per chunk, context_parallel._causal_chunks), so that
linear_proj's input, their concatenation, is a storage of its own; ``a2a`` the head-sharded q, k, v
and output (the whole sequence on heads / cp: the local bytes), copies of their own, linear_proj's
input its own too; ``p2p`` (the ring) contiguous copies of q, k, v, its output and its log-sum-exp,
linear_proj's input again its own.
With the transformer-engine spec these counts do not hold (TE modules choose what they save).

**Passes in flight** (``inflight_passes``): (chunk, micro-batch) forward passes whose activations are
all alive when the first backward of the step starts on a PP rank (megatron-core's schedules: no
pipelining 1; 1F1B min(pp - rank, M); interleaved warm-up (pp - rank - 1) * 2 + (vpp - 1) * pp, plus one).

**Resident at the peak** (``resident_at_peak``): the groups on the device at the step's peak, each
named with the reason the engine keeps it (``Resident``). Where the peak falls decides them:

- ``layer_backward``: inside a layer's backward, where a layer's backward working set peaks (the
  unfused attention's s x s gradients at real shapes). On the last stage (and PP=1) that layer is
  the last of its pass, never copied (its backward follows its forward at once; upstream never
  offloads the last layer either), and the prefetch window (``prefetch_depth`` earlier layers) was
  reloaded when its backward began, so that the copies overlap it. On other stages the peak is in the
  first layer's backward of a pass: that layer, reloaded, and the prefetch window.
- ``loss_backward``: the logits gradient of the last stage, when the vocabulary outweighs a layer's
  backward: only the last layer of the pass (never copied) is resident; no prefetch has begun.
- ``layer_forward``: inside the forward of the last layer before the first backward: that layer and
  the previous one, whose copy to the host is in flight until the layer ends (release one hook behind).

``release`` names how the engine frees a reloaded layer's buffers: ``last_use`` (now: when autograd
releases the last saved tensor that used them, after the compute stream waited for their copy) or
``next_hook`` (the release the recorded H200 run measured, docs/gpu/: held until the next layer's backward began, so the
layer's consumed reloads stayed through the rest of its backward; on the H200 that was the 1 GiB of
attention probabilities at the attention-score gradient's peak of the next layer: ``next_hook_saving``
is that exact saving, ``resident_at_peak`` counts one more group as its bound).

``theoretical_saving`` = group x (in-flight passes x layers per chunk - resident groups): what the
engine saves at least when the peak falls where ``peak`` says; R = measured saving / it (the
definition of Megatron-LM PR #1752).
"""
from __future__ import annotations

import dataclasses

from megatron_ext.attention.context_parallel import COMM_TYPES as CP_COMM_TYPES
from megatron_ext.offload.vocabulary import OffloadOptions

ATTENTION = ("unfused", "sdpa")
PEAKS = ("layer_backward", "loss_backward", "layer_forward")
RELEASES = ("last_use", "next_hook")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A layer's shape: tokens T = seq x mbs; ``dtype_bytes`` of the activations."""
    seq: int
    mbs: int
    hidden: int
    heads: int
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    ffn: int = 0  # a dense layer's MLP
    dtype_bytes: int = 4
    softmax_fp32: bool = False  # the unfused attention's softmax in fp32 on 16-bit inputs
    cp: int = 1  # context-parallel ranks: each holds seq / cp of every sequence
    cp_comm_type: str = "p2p"

    def __post_init__(self):
        if self.cp_comm_type not in CP_COMM_TYPES or self.seq % self.cp:
            raise ValueError(f"cp {self.cp}, cp_comm_type {self.cp_comm_type!r}: known {', '.join(CP_COMM_TYPES)}, "
                             f"and the sequence ({self.seq}) split evenly")

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp

    @property
    def tokens(self) -> int:
        """This rank's tokens of a micro-batch."""
        return self.local_seq * self.mbs


def qkv_linear_bytes(s: Shape, attention: str = "unfused") -> int:
    return s.tokens * s.hidden * s.dtype_bytes  # linear_qkv's input


def attention_scores_bytes(s: Shape, attention: str = "unfused") -> int:
    """The [b, heads, s, s] probabilities core attention keeps; for sdpa the fp32 log-sum-exp instead."""
    _known(attention, s)
    if attention == "sdpa":
        return s.mbs * s.heads * s.local_seq * 4
    probs = s.mbs * s.heads * s.seq * s.seq
    fp32 = probs * 4 if s.softmax_fp32 and s.dtype_bytes < 4 else 0  # the fp32 softmax output too
    return probs * s.dtype_bytes + fp32


def core_attention_bytes(s: Shape, attention: str = "unfused") -> int:
    # the fused QKV output (q, k, v are views of it) and the probabilities (sdpa: the log-sum-exp);
    # under CP what the comm type hands the kernel beyond that (see the module doc)
    qkv = s.tokens * 3 * s.hidden * s.dtype_bytes
    if s.cp > 1:
        qkv += s.tokens * s.hidden * s.dtype_bytes  # its output, a storage of its own
    if s.cp > 1 and s.cp_comm_type == "all_gather":
        qkv += s.cp * s.tokens * 2 * s.hidden * s.dtype_bytes  # the gathered keys and values
    return qkv + attention_scores_bytes(s, attention)


def output_is_proj_input(s: Shape, attention: str = "unfused") -> bool:
    """Whether core attention's saved output is linear_proj's input, one storage (sdpa: its flash
    kernel's output; under CP every comm type hands linear_proj a storage of its own)."""
    return attention == "sdpa" and s.cp == 1


def attn_proj_bytes(s: Shape, attention: str = "unfused") -> int:
    return s.tokens * s.hidden * s.dtype_bytes  # linear_proj's input


def router_fc1_bytes(s: Shape, attention: str = "unfused") -> int:
    return s.tokens * s.topk * s.hidden * s.dtype_bytes  # the permuted tokens


def moe_act_bytes(s: Shape, attention: str = "unfused") -> int:
    return 2 * s.tokens * s.topk * s.moe_ffn * s.dtype_bytes  # GELU input and output (x probs)


def router_fc2_bytes(s: Shape, attention: str = "unfused") -> int:
    return s.tokens * s.topk * s.moe_ffn * s.dtype_bytes  # fc2's input


def shared_experts_bytes(s: Shape, attention: str = "unfused") -> int:
    return 2 * s.tokens * s.shared_ffn * s.dtype_bytes  # fc1 output and fc2 input


def dense_mlp_bytes(s: Shape, attention: str = "unfused") -> int:
    return s.tokens * (s.hidden + 2 * s.ffn) * s.dtype_bytes  # fc1's input, GELU's input, fc2's input


MODULE_BYTES = {
    "qkv_linear": qkv_linear_bytes, "core_attention": core_attention_bytes, "attn_proj": attn_proj_bytes,
    "router_fc1": router_fc1_bytes, "moe_act": moe_act_bytes, "router_fc2": router_fc2_bytes,
    "shared_experts": shared_experts_bytes, "dense_mlp": dense_mlp_bytes,
}
MOE_ONLY = ("router_fc1", "moe_act", "router_fc2", "shared_experts")


def _known(attention: str, s: Shape | None = None) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention kind {attention!r}: known {', '.join(ATTENTION)}")
    if s is not None and s.cp > 1 and attention != "sdpa":
        raise ValueError(f"context parallelism ({s.cp}) runs torch attention only (sdpa), not {attention!r}")


def group_bytes(modules, moe: bool, attention: str = "unfused", **shape) -> int:
    s = Shape(**shape)
    total = 0
    for m in modules:
        if m in MOE_ONLY and (not moe or (m == "shared_experts" and not s.shared_ffn)):
            continue
        if m == "dense_mlp" and moe:
            continue  # every layer of the theory's MoE model is a MoE layer
        if m == "attn_proj" and output_is_proj_input(s, attention) and "core_attention" not in modules:
            continue  # its input is SDPA's saved output: on the device while core attention keeps it
        total += MODULE_BYTES[m](s, attention)
    return total


def inflight_passes(pp: int, vpp: int | None, pp_rank: int, microbatches: int) -> int:
    if pp == 1:
        return 1
    if not vpp:
        return min(pp - pp_rank, microbatches)
    warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp
    return min(warmup + 1, microbatches * vpp)


@dataclasses.dataclass(frozen=True)
class Resident:
    """Groups (one layer's offloaded modules, one micro-batch) on the device at the peak, and why."""
    what: str
    groups: int
    why: str


def resident_at_peak(pp: int, vpp: int | None, pp_rank: int, microbatches: int, layers_per_chunk: int,
                     prefetch_depth: int, peak: str = "layer_backward", release: str = "last_use") -> list:
    """What stays on the device at the step's peak by design (see the module's docstring)."""
    if peak not in PEAKS or release not in RELEASES:
        raise ValueError(f"peak {peak!r} (known {PEAKS}), release {release!r} (known {RELEASES})")
    passes = inflight_passes(pp, vpp, pp_rank, microbatches)
    total = passes * layers_per_chunk
    last_stage = pp_rank == pp - 1
    out = []
    if peak == "layer_forward":
        out.append(Resident("the layer computing", 1, "its saved tensors are being made"))
        out.append(Resident("the previous layer", 1, "its copy to the host is in flight: released in stream "
                            "order when this layer's forward ends (one hook behind)"))
        return _capped(out, total)
    if last_stage:
        out.append(Resident("the last layer of the pass", 1, "never copied: its backward follows its forward "
                            "at once, so offloading it could not lower the peak (upstream keeps it too)"))
    else:
        out.append(Resident("the layer being back-propagated", 1, "reloaded: backward reads it"))
    if peak == "layer_backward" or not last_stage:
        out.append(Resident("the prefetch window", prefetch_depth, "reloaded when the layer after them began "
                            "its backward, so that their copies overlap it (upstream reloads one ahead too)"))
        if release == "next_hook":
            out.append(Resident("the consumed reloads of the layer before", 1, "at most: a reloaded layer's "
                                "buffers were held until the next layer's backward began (the next_hook release)"))
    return _capped(out, total)


def _capped(resident: list, total: int) -> list:
    """No more groups resident than the pass holds."""
    out, left = [], total
    for r in resident:
        n = min(r.groups, left)
        if n > 0:
            out.append(dataclasses.replace(r, groups=n))
        left -= n
    return out


def theoretical_saving(group: int, pp: int, vpp: int | None, pp_rank: int, microbatches: int,
                       layers_per_chunk: int, prefetch_depth: int, peak: str = "layer_backward",
                       release: str = "last_use") -> int:
    passes = inflight_passes(pp, vpp, pp_rank, microbatches)
    resident = resident_at_peak(pp, vpp, pp_rank, microbatches, layers_per_chunk, prefetch_depth, peak, release)
    return group * max(0, passes * layers_per_chunk - sum(r.groups for r in resident))


def next_hook_saving(group: int, layers: int, layer_saved: int, consumed: int,
                     prefetch_depth: int = OffloadOptions.prefetch_depth) -> int:
    """PP=1, release ``next_hook``, the peak inside a layer's backward: the exact saving. At the last
    layer's peak ``layers - 1 - depth`` groups are off the device; at the peak of the layer before it
    (the same working set, ``layer_saved`` bytes of the last layer gone) one group fewer is, and the
    ``consumed`` bytes of its reloaded group (those whose last use came before that peak) are still
    held: the larger of the two peaks decides."""
    last = group * (layers - 1 - prefetch_depth)
    before = group * (layers - 2 - prefetch_depth) + layer_saved - consumed
    return max(0, min(last, before))
