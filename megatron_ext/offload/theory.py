"""What offload should save, from the model's shapes and the schedule alone (no measurement).

``group_bytes``: bytes one layer's chosen modules save for backward, per micro-batch, for the
configuration the tests and the benchmark use: local layer spec, multi-head attention (no GQA, no
rotary: q/k/v stay views of the fused QKV output), no attention dropout, non-gated GELU experts
(SequentialMLP, probabilities applied after the activation), dropless routing with TP=EP=1.
Only the local layer spec: with the transformer-engine spec (fused attention keeps no softmax
probabilities; TE modules choose what they save) these counts do not hold, so R is not computed for it.
``attention`` is the local spec's core attention (megatron_ext.attention.kernel): ``unfused`` (megatron's
DotProductAttention) keeps the fused QKV output and the [mbs, heads, s, s] softmax probabilities;
``sdpa`` (torch's scaled_dot_product_attention) keeps the fused QKV output and the fp32 log-sum-exp per
head and query (mbs x heads x s): O(s x hidden), no s x s term. It keeps its output too, which is
linear_proj's input, one storage: it moves with core_attention and attn_proj offloaded together (it is
attn_proj's bytes), and attn_proj alone moves nothing (core attention still holds that storage).

``inflight_passes``: (chunk, micro-batch) forward passes whose activations are all alive when the
first backward of the step starts on a PP rank (megatron-core's schedules: no pipelining 1;
1F1B min(pp - rank, M); interleaved warm-up (pp - rank - 1) * 2 + (vpp - 1) * pp, plus one).

``theoretical_saving`` = group_bytes x (in-flight passes x layers per chunk - K), K the groups that
must be on the device at the peak: on the last PP stage the peak is the loss/logits gradient, when
only the last layer of the pass being back-propagated is resident (it is never offloaded, K = 1); on
other stages the peak is inside the first layer's backward, when that layer and the prefetch window
are resident again (K = 1 + prefetch depth).
"""
from __future__ import annotations


def core_attention_bytes(attention: str, *, t, mbs, seq, hidden, heads, b) -> int:
    if attention == "sdpa":
        return t * 3 * hidden * b + mbs * heads * seq * 4                  # fused qkv + fp32 lse
    return t * 3 * hidden * b + mbs * heads * seq * seq * b                # fused qkv + softmax probs


def module_bytes(name: str, *, seq, mbs, hidden, heads, topk=0, moe_ffn=0, shared_ffn=0, dtype_bytes=4,
                 attention="unfused") -> int:
    t = seq * mbs
    b = dtype_bytes
    table = {
        "qkv_linear": t * hidden * b,                                    # linear_qkv input
        "core_attention": core_attention_bytes(attention, t=t, mbs=mbs, seq=seq, hidden=hidden, heads=heads, b=b),
        "attn_proj": t * hidden * b,                                     # linear_proj input
        "router_fc1": t * topk * hidden * b,                             # permuted tokens
        "moe_act": 2 * t * topk * moe_ffn * b,                           # gelu input + gelu output (x probs)
        "router_fc2": t * topk * moe_ffn * b,                            # fc2 input
        "shared_experts": 2 * t * shared_ffn * b,                        # fc1 output + fc2 input
    }
    return table[name]


def group_bytes(modules, moe: bool, **shape) -> int:
    moe_only = {"router_fc1", "moe_act", "router_fc2", "shared_experts"}
    total = 0
    for m in modules:
        if m in moe_only and (not moe or (m == "shared_experts" and not shape.get("shared_ffn"))):
            continue
        if m == "attn_proj" and shape.get("attention") == "sdpa" and "core_attention" not in modules:
            continue  # its input is SDPA's saved output: on the device while core attention keeps it
        total += module_bytes(m, **shape)
    return total


def inflight_passes(pp: int, vpp: int | None, pp_rank: int, microbatches: int) -> int:
    if pp == 1:
        return 1
    if not vpp:
        return min(pp - pp_rank, microbatches)
    warmup = (pp - pp_rank - 1) * 2 + (vpp - 1) * pp
    return min(warmup + 1, microbatches * vpp)


def theoretical_saving(group: int, pp: int, vpp: int | None, pp_rank: int, microbatches: int,
                       layers_per_chunk: int, prefetch_depth: int) -> int:
    passes = inflight_passes(pp, vpp, pp_rank, microbatches)
    resident = 1 if pp_rank == pp - 1 else 1 + prefetch_depth
    return group * max(0, passes * layers_per_chunk - resident)
