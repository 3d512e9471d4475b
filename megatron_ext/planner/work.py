"""The kernels each component of a pipeline stage runs per micro-batch, forward and backward, at the
shapes one rank computes, timed by the device's kernel model: the work ``megatron_ext.planner.steptime``
sums into a stage's time (its docstring: what each term counts)."""
from __future__ import annotations

import dataclasses


def attention_kind(args) -> str:
    """The core attention the run's layer spec builds, as megatron_ext.attention resolves
    --transformer-impl and --attention-backend: "transformer_engine" (its fused attention), "sdpa"
    (torch's scaled_dot_product_attention: auto / flash on the local spec) or "unfused" (megatron's
    DotProductAttention: unfused / local)."""
    from megatron_ext import attention

    return attention.kernel(args)


# ---------------------------------------------------------------------------------------- the shapes
@dataclasses.dataclass
class Shapes:
    """What one rank computes per micro-batch."""
    tokens: int          # T: the micro-batch's tokens (sequence x micro-batch / CP)
    norm_tokens: int     # tokens of the norms and residual adds (T / TP under sequence parallelism)
    moe_tokens: int      # tokens a MoE layer routes from this rank (T / TP with TP > 1)
    tp: int
    etp: int
    ep: int
    elem: int            # activation bytes
    grad_elem: int       # main-gradient bytes (the weight gradients accumulate into it)
    fp8: bool            # the layer linears in FP8 (transformer-engine, or torchao on the local spec)
    attention: str


def shapes(args, layout, attention: str | None = None) -> Shapes:
    """``attention``: the core attention's kind in place of the run's (``attention_kind``)."""
    from megatron_ext.planner.run import fp8_products

    tokens = args.seq_length * args.micro_batch_size // max(1, layout.cp)
    sp = args.sequence_parallel
    elem = 2 if (args.bf16 or args.fp16) else 4
    grad_elem = 4 if (args.accumulate_allreduce_grads_in_fp32 or elem == 4) else elem
    return Shapes(tokens=tokens, norm_tokens=tokens // layout.tp if sp else tokens,
                  moe_tokens=tokens // layout.tp if layout.tp > 1 else tokens, tp=layout.tp, etp=layout.etp,
                  ep=layout.ep, elem=elem, grad_elem=grad_elem, fp8=fp8_products(args),
                  attention=attention or attention_kind(args))


class _Work:
    """Seconds by term of one component's forward and backward, and each module's forward seconds
    (what a recompute of that module repeats)."""

    def __init__(self):
        self.fwd: dict = {}
        self.bwd: dict = {}
        self.modules: dict = {}  # module -> forward seconds (for recompute)

    def add(self, term: str, fwd: float, bwd: float, module: str | None = None):
        self.fwd[term] = self.fwd.get(term, 0.0) + fwd
        self.bwd[term] = self.bwd.get(term, 0.0) + bwd
        if module:
            self.modules[module] = self.modules.get(module, 0.0) + fwd

    def forward_s(self) -> float:
        return sum(self.fwd.values())

    def total(self) -> dict:
        return {k: self.fwd.get(k, 0.0) + self.bwd.get(k, 0.0) for k in {*self.fwd, *self.bwd}}


def _linear(w: _Work, dev, sh: Shapes, m: float, n: float, k: float, module: str, fp8: bool | None = None,
            groups: int = 0):
    """A linear layer's three products (forward, input gradient, weight gradient into the main
    gradient), as a grouped product over ``groups`` experts (m rows each) when given; FP8 adds the
    casts of its input and of its output gradient (16-bit read, FP8 and its transpose written: 4 bytes
    per element; transformer-engine takes the amax in the kernel before)."""
    fp8 = sh.fp8 if fp8 is None else fp8
    term = "grouped_gemm_s" if groups else "gemm_s"
    g = groups or 1
    gemm = dev.grouped_gemm_s if groups else (lambda _g, *a, **kw: dev.gemm_s(*a, **kw))
    fwd = gemm(g, m, n, k, fp8=fp8, out_elem=sh.elem)
    bwd = gemm(g, m, k, n, fp8=fp8, out_elem=sh.elem) + gemm(g, n, k, m, fp8=fp8, out_elem=sh.grad_elem,
                                                              accumulate=True)
    w.add(term, fwd, bwd, module)
    if fp8:
        w.add("memory_s", dev.memory_s(4 * g * m * k), dev.memory_s(4 * g * m * n), module)


def _norm(w: _Work, dev, sh: Shapes, width: float, module="layernorm"):
    """RMSNorm / LayerNorm: forward reads x, writes y; backward reads x and dy, writes dx."""
    n = sh.norm_tokens * width * sh.elem
    w.add("memory_s", dev.memory_s(2 * n), dev.memory_s(3 * n), module)


def _residual(w: _Work, dev, sh: Shapes, width: float):
    """A residual add (bias-dropout-add): two reads and a write each way."""
    n = sh.norm_tokens * width * sh.elem
    w.add("memory_s", dev.memory_s(3 * n), dev.memory_s(3 * n))


def _glu(args) -> bool:
    """A gated linear unit: fc1 = [gate; up] (--swiglu, or --quick-geglu as gpt-oss)."""
    return bool(args.swiglu or args.quick_geglu)


def _activation(w: _Work, dev, args, sh: Shapes, elements: float, module: str, weighted: bool = False):
    """The MLP activation on ``elements`` outputs: a fused gated unit reads both halves and writes one
    (backward: reads them and the gradient, writes two); unfused, the separate ops about twice that.
    ``weighted``: the routing probabilities applied too."""
    glu = _glu(args)
    fused = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion  # megatron's flags (no bias_activation_fusion flag)
    fwd, bwd = (3, 5) if glu else (2, 3)
    if not fused:
        fwd, bwd = 2 * fwd, 2 * bwd
    if weighted:
        fwd, bwd = fwd + 2, bwd + 3
    n = elements * sh.elem
    w.add("memory_s", dev.memory_s(fwd * n), dev.memory_s(bwd * n), module)


def attention_dims(args, tp: int) -> tuple:
    """(query heads, key / value groups, q / k head size, v head size) of core attention on a
    tensor-parallel rank (multi-latent attention: one group per head)."""
    heads = args.num_attention_heads // tp
    if args.multi_latent_attention:
        return heads, heads, args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
    groups = max(1, args.num_query_groups // tp) if args.group_query_attention else heads
    return heads, groups, args.kv_channels, args.kv_channels


def _attention_block(w: _Work, dev, args, sh: Shapes, window_share: float):
    tp, T = sh.tp, sh.tokens
    h = args.hidden_size
    heads, groups, qk, dv = attention_dims(args, tp)
    _norm(w, dev, sh, h)
    if args.multi_latent_attention:
        q_rank, kv_rank = args.q_lora_rank, args.kv_lora_rank
        if q_rank:
            _linear(w, dev, sh, T, q_rank, h, "mla_down_proj")
            _linear(w, dev, sh, T, heads * qk, q_rank, "mla_up_proj")
            _norm(w, dev, sh, q_rank, "mla_norm")
        else:
            _linear(w, dev, sh, T, heads * qk, h, "qkv")
        _linear(w, dev, sh, T, kv_rank + args.qk_pos_emb_head_dim, h, "mla_down_proj")
        _norm(w, dev, sh, kv_rank, "mla_norm")
        _linear(w, dev, sh, T, heads * (args.qk_head_dim + dv), kv_rank, "mla_up_proj")
        rope = T * (heads + 1) * args.qk_pos_emb_head_dim
    else:
        d = qk
        _linear(w, dev, sh, T, (heads + 2 * groups) * d, h, "qkv")
        rope = T * (heads + groups) * d if args.position_embedding_type in ("rope", "yarn", "mrope") else 0
    if rope:
        fused = args.apply_rope_fusion
        w.add("memory_s", dev.memory_s((2 if fused else 10) * rope * sh.elem),
              dev.memory_s((2 if fused else 8) * rope * sh.elem))
    # the whole sequence's (query, key) pairs; a context-parallel rank computes 1 / CP of them (megatron's
    # load-balanced split gives every rank the same share of the causal triangle)
    cp = max(1, args.context_parallel_size)
    s, b = args.seq_length, args.micro_batch_size
    full_pairs = s * (s + 1) / 2
    window = _window(args)
    pairs = full_pairs
    if window is not None and window_share:
        wp = s * (window + 1) - window * (window + 1) / 2 if window < s else full_pairs
        pairs = (1 - window_share) * full_pairs + window_share * wp
    pairs /= cp
    att = dict(fwd=dev.attention_s(sh.attention, b, heads, s // cp, qk, dv, pairs, "fwd"),
               bwd=dev.attention_s(sh.attention, b, heads, s // cp, qk, dv, pairs, "bwd"))
    w.add("attention_s", att["fwd"], att["bwd"], "core_attn")
    _linear(w, dev, sh, T, h, heads * dv, "attn_proj")
    _residual(w, dev, sh, h)


def _window(args):
    ws = args.window_size
    if not ws:
        return None
    left = ws[0] if isinstance(ws, (tuple, list)) else ws
    return None if left is None or left < 0 else int(left)


def window_share(args) -> float:
    """Share of the decoder layers that attend in a sliding window (megatron's is_layer_window_attention)."""
    if _window(args) is None:
        return 0.0
    from megatron.core.transformer.utils import is_layer_window_attention

    n = args.num_layers
    skip = args.window_attn_skip_freq
    return sum(is_layer_window_attention(args.window_size, skip, i + 1) for i in range(n)) / n


def _mlp(w: _Work, dev, args, sh: Shapes, ffn: int, tokens: int, module: str = "mlp"):
    glu = 2 if _glu(args) else 1
    _linear(w, dev, sh, tokens, glu * ffn // sh.tp, args.hidden_size, module)
    _activation(w, dev, args, sh, tokens * ffn // sh.tp, module)
    _linear(w, dev, sh, tokens, args.hidden_size, ffn // sh.tp, module)


def _moe_block(w: _Work, dev, args, sh: Shapes):
    h = args.hidden_size
    E, topk = args.num_experts, args.moe_router_topk or 1
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    glu = 2 if _glu(args) else 1
    Tm = sh.moe_tokens
    _linear(w, dev, sh, Tm, E, h, "router", fp8=False)
    w.add("memory_s", dev.memory_s(6 * Tm * E * 4), dev.memory_s(4 * Tm * E * 4), "router")  # scores, top-k (fp32)
    rows = Tm * topk * sh.etp  # rows this rank's experts compute (balanced routing)
    local = max(1, E // sh.ep)
    permute = (rows + Tm) * h * sh.elem * (1 if args.moe_permute_fusion else 2)
    w.add("memory_s", dev.memory_s(2 * permute), dev.memory_s(2 * permute))  # permute and unpermute
    if sh.ep > 1 and local > 1:  # the all-to-all dispatcher re-sorts what it receives by expert, and back
        w.add("memory_s", dev.memory_s(4 * rows * h * sh.elem), dev.memory_s(4 * rows * h * sh.elem))
    per_expert = rows / local
    _linear(w, dev, sh, per_expert, glu * ffn // sh.etp, h, "moe", groups=local)
    _activation(w, dev, args, sh, rows * ffn // sh.etp, "moe_act", weighted=True)
    _linear(w, dev, sh, per_expert, h, ffn // sh.etp, "moe", groups=local)
    shared = args.moe_shared_expert_intermediate_size
    if shared:
        _mlp(w, dev, args, sh, shared, sh.tokens, "shared_experts")


def component_work(args, sh: Shapes, dev, comp) -> _Work:
    """Forward and backward seconds by term of one component per micro-batch."""
    w = _Work()
    h = args.hidden_size
    if comp == "embedding":
        rows = sh.norm_tokens * h * sh.elem
        vocab = args.padded_vocab_size or args.vocab_size
        # gather forward; backward: the dense [vocab / TP, h] gradient written, then added into the main one
        w.add("memory_s", dev.memory_s(2 * rows), dev.memory_s(vocab // sh.tp * h * (sh.grad_elem * 3)))
        return w
    if comp == "head":
        vocab = args.padded_vocab_size or args.vocab_size
        _norm(w, dev, sh, h, "final_norm")
        _linear(w, dev, sh, sh.tokens, vocab // sh.tp, h, "output", fp8=False)
        logits = sh.tokens * vocab // sh.tp
        fused = args.cross_entropy_loss_fusion
        # per logit: fused, read forward, read and write backward; unfused, the fp32 copy, max, exp,
        # sum, the softmax kept, and its gradient cast back
        w.add("memory_s", dev.memory_s(logits * (2 if fused else 38)), dev.memory_s(logits * (4 if fused else 22)))
        return w
    _, kind = comp
    _attention_block(w, dev, args, sh, window_share(args))
    _norm(w, dev, sh, h)
    if kind == "moe":
        _moe_block(w, dev, args, sh)
    else:
        _mlp(w, dev, args, sh, args.ffn_hidden_size, sh.tokens)
    _residual(w, dev, sh, h)
    return w


def recompute_s(work: _Work, comp, recompute) -> float:
    granularity, modules = recompute
    if not isinstance(comp, tuple):
        return 0.0
    if granularity == "full":
        return work.forward_s()
    if granularity != "selective":
        return 0.0
    names = {"core_attn": ("core_attn",), "layernorm": ("layernorm",), "moe_act": ("moe_act",),
             "mla_up_proj": ("mla_up_proj",), "mlp": ("mlp",), "moe": ("moe", "moe_act", "router"),
             "shared_experts": ("shared_experts",)}
    return sum(work.modules.get(x, 0.0) for m in modules for x in names.get(m, ()))
