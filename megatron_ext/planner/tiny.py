"""The tiny copy of the run that the planner traces: its arguments (every width divided by a power of
two, two layers per kind, no pipeline / expert / context parallelism, fewer experts where the router
allows) and the base shape of the trace. See megatron_ext/planner/trace.py."""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math

from megatron_ext.planner.run import (MODELED_RECOMPUTE, fixed_budget_rows, layer_kinds, local_seq, local_unfused,
                                      on_transformer_engine, recompute_of)

_WIDTH_FIELDS = ("hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "kv_channels",
                 "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                 "qk_pos_emb_head_dim", "v_head_dim")
_TP_SHARDED = ("ffn_hidden_size", "moe_shared_expert_intermediate_size")
BASE = dict(vocab=64, seq=16, mbs=2)  # mbs 1 would skip copies (a transpose of one sample is contiguous)
MIN_HEAD_DIM = 4  # smallest traced head / rope dimension
MIN_EXPERTS = 16  # fewest routed experts a trace of a model with more keeps
# per-layer patterns megatron's config checks against the number of layers (--no-rope-freq as a list,
# transformer/transformer_config.py:2825) or reads per layer number
_PER_LAYER = ("no_rope_freq", "window_attn_skip_freq", "cp_comm_type")


def width_divisor(args) -> int:
    """Largest power of two W (trace hidden >= 16) such that every width field / W still divides
    by the tensor (expert) parallel size, with head dimensions >= MIN_HEAD_DIM after division (the
    width-doubled trace, at W / 2, only grows them)."""
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    values = []
    for f in _WIDTH_FIELDS:
        v = getattr(args, f)
        if not v:
            continue
        if f in _TP_SHARDED:
            v //= tp
        elif f == "moe_ffn_hidden_size":
            v //= etp
        values.append((f, v))
    w = 1
    while True:
        nxt = w * 2
        ok = all(v % nxt == 0 for _, v in values) and args.hidden_size // nxt >= 16
        ok = ok and all(v // nxt >= MIN_HEAD_DIM for f, v in values if f not in ("hidden_size",))
        if not ok:
            return w
        w = nxt


def traced_experts(args) -> int:
    """Routed experts of the trace: the fewest (a divisor of the run's count, twice it still a
    divisor, at least MIN_EXPERTS or half the run's count) that the router's top-k and expert groups
    allow; the run's when none does. Experts are identical, so what the run's count changes (expert
    parameters, the router's [tokens, experts] tensors, fewer tokens per expert, copies of the local
    experts' weights) is measured by a trace at twice the traced count and scaled (the ``experts``
    factor)."""
    n = args.num_experts or 0
    k = args.moe_router_topk or 1
    groups = args.moe_router_num_groups or 1
    group_topk = args.moe_router_group_topk or groups
    for e in range(min(MIN_EXPERTS, n // 2), n // 2 + 1):
        if e and n % (2 * e) == 0 and e % groups == 0 and e * group_topk // groups >= k:
            return e
    return n


@dataclasses.dataclass
class TinyRun:
    """The tiny copy the trace runs: its arguments (a whole parse's, shrunk) and how the trace runs it."""

    args: argparse.Namespace
    budget_rows_per_token: float | None = None
    """The fixed-budget dispatcher's buffer rows per token, as the run's (None: no such dispatcher)."""
    fused_attention: bool = False
    """Core attention keeps what transformer-engine's fused kernel keeps (seams.planner)."""
    context_parallel: int = 1
    """Torch attention attends as one rank of this many context-parallel ranks, simulated on the
    trace's process with the layer's --cp-comm-type (attention.context_parallel.simulated)."""


def trace_args(args, divisor: int, vocab: int, seq: int, mbs: int, experts: int, kinds: list,
               recompute=None) -> TinyRun:
    """A copy of the run's arguments for the tiny model: one layer per kind, the run's tensor
    parallelism (and sequence parallelism), no pipeline or expert parallelism, ``experts`` routed
    experts; a context-parallel rank's share of the sequence, its attention one CP rank simulated."""
    a = copy.deepcopy(args)
    rows_per_token = None
    if args.num_experts:
        a.num_experts = experts
        rows = fixed_budget_rows(args, args.expert_model_parallel_size, args.tensor_model_parallel_size)
        # the fixed-budget dispatcher's experts run on every row of its buffers, padding included: the
        # trace (one rank, no expert parallelism) sizes them as the run does, per token
        rows_per_token = rows / (local_seq(args) * args.micro_batch_size
                                 // args.tensor_model_parallel_size) if rows else None
    for f in _WIDTH_FIELDS:
        v = getattr(a, f)
        if v:
            setattr(a, f, v // divisor)
    a.pipeline_model_parallel_size = a.expert_model_parallel_size = 1
    # without expert parallelism: megatron's all-to-all dispatcher (the flex one needs EP; the exchange's
    # buffers are counted from the dispatcher's rules, memory.py) and no EP communication to overlap
    if a.moe_token_dispatcher_type == "flex":
        a.moe_token_dispatcher_type = "alltoall"
    a.overlap_moe_expert_parallel_comm = a.delay_wgrad_compute = False
    a.context_parallel_size = 1
    a.virtual_pipeline_model_parallel_size = None
    a.num_layers_per_virtual_pipeline_stage = None
    a.decoder_first_pipeline_num_layers = a.decoder_last_pipeline_num_layers = None
    a.account_for_embedding_in_pipeline_split = a.account_for_loss_in_pipeline_split = False
    a.pipeline_model_parallel_layout = None
    a.num_layers = len(kinds)
    if args.num_experts:
        a.moe_layer_freq = [1 if k == "moe" else 0 for k in kinds]
        a.moe_layer_freq = a.moe_layer_freq if len(set(kinds)) > 1 else 1
    for name in _PER_LAYER:
        if isinstance(getattr(args, name), list):
            setattr(a, name, per_layer(args, getattr(args, name), kinds))
    a.mtp_num_layers = None
    a.padded_vocab_size = a.vocab_size = vocab
    a.seq_length = seq
    a.max_position_embeddings = max(seq, 2)
    a.micro_batch_size = mbs
    a.activation_offload_modules = None
    a.lora_rank = None  # LoRA's adapters are counted from the flags (memory.py); a rank may exceed the tiny widths
    a.fp8 = None
    a.fp8_param_gather = False
    modules = ["core_attn"]
    if recompute is None:  # as the run (full recompute: of every traced layer)
        recompute = recompute_of(args)
        modules = list(args.recompute_modules or modules)
    a.recompute_granularity = a.recompute_method = a.recompute_num_layers = None
    a.recompute_modules = None
    # moe_act recompute needs grouped-GEMM experts (the local copy builds sequential ones), layernorm
    # recompute transformer-engine: traced without them, modeled by ``run.modeled_saved_delta``
    kept = [m for m in modules if m not in MODELED_RECOMPUTE]
    modules = kept or (["core_attn"] if len(kept) < len(modules) else modules)
    if recompute == "selective" and modules:
        a.recompute_granularity, a.recompute_modules = "selective", modules
    elif recompute == "full":
        a.recompute_granularity, a.recompute_method, a.recompute_num_layers = "full", "uniform", 1
    a.overlap_tp_comm_1f1b = False
    local_unfused(a)
    a.overlap_grad_reduce = a.overlap_param_gather = False
    a.use_distributed_optimizer = False
    a.cross_entropy_loss_fusion = False
    a.moe_layer_recompute = False
    fused_attention = on_transformer_engine(args)  # core attention as TE's keeps (seams.planner)
    if fused_attention:
        # the cluster's fused kernels that keep less than the unfused ones: megatron's SwiGLU (its
        # own, runs here) and TE's RoPE (a stand-in that saves what it saves, seams.planner); not
        # multi-latent attention's fused RoPE (a Triton kernel): traced unfused, an upper bound
        a.bias_swiglu_fusion = args.bias_swiglu_fusion
        a.apply_rope_fusion = args.apply_rope_fusion and not args.multi_latent_attention
    return TinyRun(a, rows_per_token, fused_attention, args.context_parallel_size or 1)


def per_layer(args, values: list, kinds: list) -> list:
    """A per-layer pattern of the run (one value per layer) for the traced layers: each the value most
    of the run's layers of its kind have (the traced layers stand for every layer of their kind)."""
    run_kinds = layer_kinds(args)
    out = []
    for kind in kinds:
        of_kind = [v for v, k in zip(values, run_kinds) if k == kind] or list(values)
        out.append(max(sorted(set(of_kind)), key=of_kind.count))
    return out


def base_shape(args, experts: int, base: dict | None = None) -> dict:
    """The trace's base vocabulary, sequence and micro-batch size. With experts, the sequence is the
    smallest (from BASE's) that gives every traced expert the same whole number of tokens under
    balanced routing, at every traced shape and with twice the experts (tokens per rank: sequence x
    micro-batch / TP under sequence parallelism)."""
    b = dict(BASE, **(base or {}))
    if args.num_experts:
        k, tp = args.moe_router_topk or 1, args.tensor_model_parallel_size
        need = 2 * experts * tp
        step = math.lcm(need // math.gcd(need, b["mbs"] * k), tp)  # seq x mbs x k a multiple of need
        b["seq"] = step * math.ceil(b["seq"] / step)
    return b
