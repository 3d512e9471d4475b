"""Core attention through torch's own kernels: ``F.scaled_dot_product_attention`` (SDPA) everywhere,
``flex_attention`` with block masks on CUDA where a mask is needed. Plain torch, no megatron-core.

``attend(q, k, v, ...)`` computes what megatron-core's DotProductAttention computes (softmax of the
scaled scores under its mask, then the values), with its mask conventions:

  causal               a causal layer without a mask: the causal triangle (``is_causal``, no mask tensor)
  mask                 megatron's: True where a query may NOT see a key, [b or 1, 1, sq, sk] (a packed
                       row's per-conversation mask, the data loader's); used as given, never re-derived
  window (w0, w1)      a sliding-window layer: query i sees keys i - w0 .. i + w1 (megatron's
                       get_sliding_window_causal_mask); with a mask given, both must allow a key
  sink [heads]         the per-head logit of a softmax sink (--softmax-type off-by-one / learnable):
                       softmax over [scores, sink], the sink's column then dropped (megatron's SoftmaxOne)

Sinks are exact through the kernels. SDPA: one key is put in front of the keys (value 0, so it adds
only its exp(sink) to each softmax denominator) and one query in front of the queries (its row
discarded), so that the square causal triangle still lines up every real query with its keys. The
sink key scores ``sink`` against every query through two extra head dimensions: the query carries the
sink split in a high and a low part (``sink / scale`` rounded to the input dtype, then the remainder),
the sink key carries ones there and the real keys zeros. The gradient of the sink comes back through
the query's extra dimensions. Head dimensions are then padded to a multiple of 8 (the fused kernels'
alignment). flex_attention: the same key of zeros in front, its score set to ``sink`` by a score_mod
(the sink a captured tensor, its gradient flex_attention's).

Values narrower than queries and keys (multi-latent attention) are zero-padded to the query head size,
and the output sliced: the fused kernels take one head size for all three (CPU's flash kernel, CUDA's
flash), and the padded columns are exact zeros that change nothing of the others.

Which kernel runs (torch picks among its backends for SDPA; the choices here are what it is given):
  CPU    SDPA: its flash kernel (causal, masks, GQA; saves q, k, v, the output and the fp32 log-sum-exp),
         its math kernel with attention dropout (which materialises the probabilities).
  CUDA   no mask: SDPA with ``is_causal`` (flash, memory-efficient or cuDNN as torch picks; GQA
         natively where torch's flash takes it: fp16 / bf16). A mask (packed documents, a window) and
         no dropout, head sizes powers of two: ``flex_attention``, compiled once per process, with a
         block mask (documents from the row's segment ids where the mask carries them, else read from
         the mask; built once per micro-batch over the [s, s] grid), GQA natively. Otherwise (dropout:
         flex has none; other head sizes, e.g. multi-latent attention's 192) SDPA with the additive mask
         (memory-efficient), keys and values repeated per query head (its GQA is flash / math only).
  ``attend_lower_right`` (context parallelism's all_gather chunks: queries the last of the key
  positions, causal aligned to the bottom right): CUDA SDPA with torch's ``causal_lower_right`` bias
  (flash's own causal in fp16 / bf16), CPU SDPA with that triangle as a mask.
  Not measured on GPU: which backend torch takes, and its speed, are expectations from torch's
  documentation.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ALIGN = 8  # head dimensions the fused kernels take (a multiple of 8)
_DOCUMENTS = "_megatron_ext_segments"  # on a packed row's mask: [b, s] segment ids (sft/attention.py)
_DERIVED = "_megatron_ext_attention"  # on a given mask: what attend() derived from it, per micro-batch


def mark_documents(mask: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Record on a packed row's mask the segment ids it was made from ([b, s]): where flex_attention
    runs, its block mask is built from them (a document mask) instead of reading the dense mask."""
    setattr(mask, _DOCUMENTS, segments)
    return mask


def _derived(mask: torch.Tensor, key, make):
    """What attend() derives from a given mask (its inverse, with a window, a block mask), made once per
    mask object: every layer of a micro-batch gets the same mask, so its layers share one tensor."""
    cache = getattr(mask, _DERIVED, None)
    if cache is None:
        cache = {}
        setattr(mask, _DERIVED, cache)
    if key not in cache:
        cache[key] = make()
    return cache[key]


def window_keep(sq: int, sk: int, window, device) -> torch.Tensor:
    """[sq, sk] bool, True = attended: megatron's sliding window (transformer/utils.py
    get_sliding_window_causal_mask, inverted), made on ``device``."""
    return _window_keep(sq, sk, int(window[0]), int(window[1]), str(torch.device(device)))


@functools.lru_cache(maxsize=8)
def _window_keep(sq, sk, before, after, device):
    ones = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return torch.tril(torch.triu(ones, diagonal=sk - sq - before), diagonal=sk - sq + after)


def _with_sink_rows(keep: torch.Tensor) -> torch.Tensor:
    """keep [..., sq, sk] -> [..., sq + 1, sk + 1]: the sink's query row sees only the sink key, every
    real query sees the sink key and what it saw."""
    out = F.pad(keep, (1, 0, 1, 0), value=True)
    out[..., 0, 1:] = False
    return out


def _sink_inputs(q, k, v, sink, scale):
    """q [b, h, s, d], k [b, g, s, d], v [b, g, s, dv] -> the same with the sink key (and a query row)
    in front and two extra head dimensions (then padded to ALIGN) carrying its score."""
    b, h, s, d = q.shape
    g = k.shape[1]
    width = -(-(d + 2) // ALIGN) * ALIGN
    exact = sink.float()  # the split in fp32: the low part is what the input dtype lost of the high one
    high = (exact / scale).to(q.dtype)
    low = ((exact - high.float() * scale) / scale).to(q.dtype)
    extra = F.pad(torch.stack([high, low], dim=-1), (0, width - d - 2))  # [h, width - d]
    q = torch.cat([q, extra.view(1, h, 1, -1).expand(b, h, s, -1)], dim=-1)
    q = torch.cat([q.new_zeros(b, h, 1, width), q], dim=2)
    sink_key = q.new_zeros(b, g, 1, width)
    sink_key[..., d:d + 2] = 1
    k = torch.cat([sink_key, F.pad(k, (0, width - d))], dim=2)
    v = torch.cat([v.new_zeros(b, g, 1, v.shape[-1]), v], dim=2)
    return q, k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
           mask: torch.Tensor | None = None, window=None, sink: torch.Tensor | None = None,
           dropout_p: float = 0.0, use_flex: bool | None = None) -> torch.Tensor:
    """q [b, h, sq, d], k [b, g, sk, d], v [b, g, sk, dv] (h a multiple of g) -> [b, h, sq, dv].
    ``use_flex``: None = flex_attention where a mask is needed on CUDA (see the module doc); True
    forces it (flex_attention runs forward only on CPU)."""
    sq, sk, dv = q.shape[2], k.shape[2], v.shape[-1]
    window = None if window is None else (int(window[0]), int(window[1]))
    masked = mask is not None or window is not None
    if masked:
        causal = False  # the mask (and the window) say everything; megatron's window replaces the triangle
    elif causal:
        assert sq == sk, "causal mask is only for self attention"
        causal = sq > 1  # one query (a KV cache, a single token) sees every key
    if use_flex is None:
        use_flex = q.is_cuda and masked and dropout_p == 0.0 and _flex_takes(q, v)
    if use_flex and masked:
        return _flex(q, k, v, mask, window, sink, scale)
    if sink is not None:
        q, k, v = _sink_inputs(q, k, v, sink, scale)
    if v.shape[-1] != q.shape[-1]:  # multi-latent attention's narrower values
        v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
    keep = _keep(mask, window, sq, sk, q.device, sink is not None, q.dtype)
    out = _sdpa(q, k, v, keep, causal, scale, dropout_p)
    if sink is not None:
        out = out[:, :, 1:]
    return out[..., :dv]


def attend_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention of queries that are the last ``sq`` of the ``sk`` key positions: query i sees
    keys up to sk - sq + i (the triangle aligned to the bottom right, flash attention's own causal).
    CUDA: SDPA with torch's ``causal_lower_right`` bias (flash's lower-right causal in fp16 / bf16, GQA
    natively; torch picks otherwise); elsewhere SDPA with that triangle as an additive mask, one per
    shape. Shapes as ``attend``'s."""
    sq, sk, dv = q.shape[2], k.shape[2], v.shape[-1]
    if sq == sk:
        return attend(q, k, v, scale=scale, causal=True)
    if v.shape[-1] != q.shape[-1]:  # multi-latent attention's narrower values
        v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(sq, sk), scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = _sdpa(q, k, v, _lower_right_keep(sq, sk, str(q.device), q.dtype), False, scale, 0.0)
    return out[..., :dv]


@functools.lru_cache(maxsize=8)
def _lower_right_keep(sq, sk, device, dtype):
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device).tril_(sk - sq)
    return _additive(keep.view(1, 1, sq, sk), False, dtype)


def _keep(mask, window, sq, sk, device, sink, dtype):
    """What SDPA takes as its mask, or None: 0 where attended, -inf elsewhere, in the inputs' dtype (a
    boolean mask would be turned into such a tensor by every call, and kept for backward by each layer).
    A given mask's is made once per micro-batch (every layer keeps the same one), a window's once per
    shape; shifted for a sink."""
    if mask is not None:
        return _derived(mask, ("keep", window, sink, dtype), lambda: _additive(
            ~mask if window is None else ~mask & window_keep(sq, sk, window, mask.device), sink, dtype))
    if window is not None:
        return _additive_window(sq, sk, window, str(torch.device(device)), sink, dtype)
    return None


def _additive(keep: torch.Tensor, sink: bool, dtype) -> torch.Tensor:
    """keep (True = attended; shifted for a sink) as SDPA's additive mask: 0 / -inf in ``dtype``."""
    keep = _with_sink_rows(keep) if sink else keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


@functools.lru_cache(maxsize=8)
def _additive_window(sq, sk, window, device, sink, dtype):
    return _additive(window_keep(sq, sk, window, device), sink, dtype)


def _sdpa(q, k, v, keep, causal, scale, dropout_p):
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and (keep is not None or q.dtype not in (torch.float16, torch.bfloat16)):
        # torch's GQA on CUDA is its flash and math kernels only: a mask or fp32 would take the math one
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=causal,
                                          scale=scale, enable_gqa=gqa)


# ------------------------------------------------------------------------------------------------ flex
def _flex_takes(q, v) -> bool:
    """Head sizes flex_attention's kernels are known to take: powers of two from 16 (others it pads
    or refuses depending on the torch version: those layers keep SDPA with the mask)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (q.shape[-1], v.shape[-1]))


def mask_mod_for(mask: torch.Tensor | None, window, sink: bool):
    """flex_attention's mask_mod (True = attended) for what attend() gives SDPA: a packed row's
    documents (causal inside each segment) from the segment ids its mask carries (mark_documents),
    else the given mask read at (query, key); the window from the indices; with a sink, its key in
    front of the keys, seen by every query. No [s, s] tensor is made for a window or documents."""
    documents = None if mask is None else getattr(mask, _DOCUMENTS, None)
    if documents is not None:
        def base(b, h, q_idx, kv_idx):
            return (documents[b, q_idx] == documents[b, kv_idx]) & (kv_idx <= q_idx)
    elif mask is not None:
        masked = mask[:, 0] if mask.dim() == 4 else mask.unsqueeze(0)
        per_row = masked.shape[0] > 1

        def base(b, h, q_idx, kv_idx):
            return ~masked[b if per_row else 0, q_idx, kv_idx]
    else:
        def base(b, h, q_idx, kv_idx):
            return kv_idx == kv_idx  # everything (the window below says what is not)
    inner = base
    if window is not None:
        before, after = window

        def inner(b, h, q_idx, kv_idx):  # noqa: F811 - the base, windowed
            return base(b, h, q_idx, kv_idx) & (kv_idx >= q_idx - before) & (kv_idx <= q_idx + after)
    if not sink:
        return inner

    def with_sink(b, h, q_idx, kv_idx):
        return (kv_idx == 0) | ((kv_idx > 0) & inner(b, h, q_idx, (kv_idx - 1).clamp(min=0)))
    return with_sink


def _block_mask(q, k, mask, window, sink):
    """The BlockMask of this layer's pattern, made once per micro-batch (cached on the given mask) or,
    for a window alone, once per shape. q / k as the kernel gets them (a sink's key included)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, cols = q.shape[2], k.shape[2]
    if mask is None:
        return _window_block_mask(rows, cols, window, sink, str(q.device))
    per_row = getattr(mask, _DOCUMENTS, None) is not None or mask.shape[0] > 1
    return _derived(mask, ("block", window, sink, rows, cols), lambda: create_block_mask(
        mask_mod_for(mask, window, sink), q.shape[0] if per_row else None, None, rows, cols, device=q.device))


@functools.lru_cache(maxsize=8)
def _window_block_mask(rows, cols, window, sink, device):
    """A window's BlockMask (its mask_mod reads only the indices: one for every batch and head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod_for(None, window, sink), None, None, rows, cols, device=device)


_COMPILED: list = []  # flex_attention compiled once per process, on first use on CUDA


def _flex(q, k, v, mask, window, sink, scale):
    """flex_attention over the layer's block mask; a sink is a key of zeros in front of the keys (a
    value of zeros: it adds only exp(sink) to each denominator) whose score the score_mod sets."""
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if sink is not None:
        b, g = k.shape[:2]
        k = torch.cat([k.new_zeros(b, g, 1, k.shape[-1]), k], dim=2)
        v = torch.cat([v.new_zeros(b, g, 1, v.shape[-1]), v], dim=2)

        def score_mod(score, b_idx, h_idx, q_idx, kv_idx):
            return torch.where(kv_idx == 0, sink[h_idx].to(score.dtype), score)
    block = _block_mask(q, k, mask, window, sink is not None)
    fn = flex_attention
    if q.is_cuda:  # eager flex_attention materialises the scores; compiled, it is one fused kernel
        if not _COMPILED:
            _COMPILED.append(torch.compile(flex_attention, dynamic=False))
        fn = _COMPILED[0]
    return fn(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
