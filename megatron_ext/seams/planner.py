"""Seams of the planner's trace (megatron_ext/planner/trace.py); scoped, applied only around a trace.

Wrapped while the planner traces a tiny copy of a MoE model (``balanced_routing()``):
  router.topk_routing_with_score_function   imported transformer/moe/router.py:24, called by
      TopKRouter.routing at :774 (defined moe_utils.py:710). The router's own score function and
      top-k still run (their tensors are part of the trace), then the selected experts are replaced,
      through the function's ``router_replay`` hook (its top-k step, moe_utils.py:831; megatron's
      RouterReplay protocol, router_replay.py:137), by a balanced assignment: token t's j-th choice
      is expert (t * topk + j) mod E. Every expert then gets tokens x topk / E tokens at every traced
      shape, so which experts receive tokens does not depend on the weights, the seed or the shape,
      and the trace's storages match one to one across shapes and expert counts.
Wrapped while the planner traces (``buffer_requests()``):
  GlobalMemoryBuffer.get_tensor   utils.py:701 (called by the sequence-parallel gathers,
      tensor_parallel/mappings.py:143, :183, layers.py:570, and the local attention's score buffer,
      transformer/dot_product_attention.py:189): each request's (name, dtype) and bytes recorded.
      The buffer is the largest request per key, and different requests scale differently (a
      gather with the hidden size, the attention scores with the sequence squared), so the planner
      scales each request and takes the largest at the target.
Wrapped while the planner traces the tiny copy of a run on transformer-engine (``fused_attention()``):
  DotProductAttention.forward   transformer/dot_product_attention.py:142 (the local spec's core
      attention, which materialises [b, heads, s, s] scores and keeps its softmax for backward).
      Replaced by a stand-in that keeps for backward what transformer-engine's fused attention keeps
      (FusedAttnFunc.forward, transformer_engine/pytorch/attention/dot_product_attention/backends.py:
      ``save_for_backward(q, k, v, out, cu_seqlens..., *aux_ctx_tensors)``, the aux tensors being the
      softmax statistics, fp32 [b, heads, s, 1], and the RNG state): q, k, v, the output and a
      [b, heads, s] fp32 statistic. It computes through torch's flash-attention kernel, whose scores
      never exist as a tensor (causal; dropout is not applied: the trace counts bytes, not values).
  torch.nn.RMSNorm.forward / torch.nn.LayerNorm.forward   the local spec's norms (megatron's
      transformer/torch_norm.py:56 WrappedTorchNorm builds them), which on CPU save fp32 copies of
      their input for backward. Replaced by one that keeps what transformer-engine's norms keep
      (TENorm -> te.pytorch RMSNorm / LayerNorm, ``_LayerNorm`` / ``_RMSNorm`` forward:
      ``save_for_backward(inputmat, weight, [mu,] rsigma)``): the input in its dtype and fp32
      statistics per row.
  utils._te_version   utils.py:71 (read by is_te_min_version, :326): the transformer-engine version the
      cluster is assumed to have (seams/te_spec.py ASSUMED_TE_VERSION) instead of this machine's none, for
      megatron's config checks of the fused kernels the trace stands in for (rotary_interleaved with
      apply_rope_fusion: transformer/transformer_config.py:2173).
"""
from __future__ import annotations

import contextlib

import torch

from megatron_ext.patching import Patch, set_attr


class _BalancedChoice:
    """A RouterReplay stand-in: the router's top-k is computed (its memory is the run's), its
    choice replaced by the balanced one, probabilities gathered at the replaced indices."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        index = balanced_indices(*scores.shape[:1], topk, scores.shape[1], scores.device)
        return scores.gather(1, index), index


def balanced_indices(tokens: int, topk: int, experts: int, device=None) -> torch.Tensor:
    """The assignment the seam makes: [tokens, topk] expert indices."""
    return (torch.arange(tokens, device=device).unsqueeze(1) * topk
            + torch.arange(topk, device=device).unsqueeze(0)) % experts


def _install_balanced_routing():
    from megatron.core.transformer.moe import router

    original = router.topk_routing_with_score_function

    def topk_routing_with_score_function(logits, topk, *args, **kwargs):
        kwargs["router_replay"] = _BalancedChoice()
        kwargs["fused"] = False  # the fused kernel has no replay hook
        return original(logits, topk, *args, **kwargs)

    return set_attr(router, "topk_routing_with_score_function", topk_routing_with_score_function)


_REQUESTS: list = []  # the active recorders, innermost last


def _install_buffer_requests():
    from megatron.core.utils import GlobalMemoryBuffer

    original = GlobalMemoryBuffer.get_tensor

    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        out = original(self, tensor_shape, dtype, name, *args, **kwargs)
        if _REQUESTS:
            _REQUESTS[-1].append((f"{name}:{dtype}", out.numel() * out.element_size()))
        return out

    return set_attr(GlobalMemoryBuffer, "get_tensor", get_tensor)


BALANCED_ROUTING = Patch(
    "planner.balanced_routing",
    ["megatron/core/transformer/moe/router.py:24", "megatron/core/transformer/moe/router.py:774",
     "megatron/core/transformer/moe/moe_utils.py:831"],
    "planner trace only: every expert gets the same tokens at every traced shape (shape-stable storages)",
    _install_balanced_routing,
)
BUFFER_REQUESTS = Patch(
    "planner.buffer_requests",
    ["megatron/core/utils.py:701", "megatron/core/tensor_parallel/mappings.py:143",
     "megatron/core/transformer/dot_product_attention.py:189"],
    "planner trace only: the global memory buffer's requests, each scaled on its own",
    _install_buffer_requests,
)
class _FusedAttention(torch.autograd.Function):
    """q [sq, b, heads, d], k / v [sk, b, groups, d(v)] -> [sq, b, heads x dv]; saves q, k, v, out and
    the [b, heads, sq] fp32 log-sum-exp (TE's softmax statistics), nothing of size s x s."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        with torch.no_grad():
            out, lse = _flash(q, k, v, scale)
            out = out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)  # [sq, b, heads x dv]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _out, _lse = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = _flash(q_, k_, v_, ctx.scale)[0].permute(2, 0, 1, 3).reshape(grad.shape)
            dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), grad)
        return dq, dk, dv, None


def _flash(q, k, v, scale):
    """(out [b, heads, sq, dv], lse [b, heads, sq]) through the flash kernel (no score tensor)."""
    heads, groups, d, dv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if groups != heads:
        kb, vb = (t.repeat_interleave(heads // groups, dim=1) for t in (kb, vb))
    if dv != d:  # multi-latent attention: values narrower than queries and keys
        vb = torch.nn.functional.pad(vb, (0, d - dv))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qb, kb, vb, 0.0, True, scale=scale)[:2]
    return out[..., :dv], lse


class _TENorm(torch.autograd.Function):
    """y = norm(x) as the module computes it; saves x, the weight and fp32 [rows, 1] statistics
    (rstd, and the mean for LayerNorm), as transformer-engine's norms do."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        with torch.no_grad():
            y = module._planner_forward(x)
            xf = x.float()
            stats = [xf.mean(-1, keepdim=True)] if isinstance(module, torch.nn.LayerNorm) else []
            rstd = torch.rsqrt(((xf - stats[0]) if stats else xf).pow(2).mean(-1, keepdim=True) + (module.eps or 1e-6))
            del xf
        ctx.save_for_backward(x, weight, *stats, rstd)
        ctx.module = module
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors[:2]
        module = ctx.module
        with torch.enable_grad():
            x_ = x.detach().requires_grad_()
            y = module._planner_forward(x_)
            params = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
            grads = torch.autograd.grad(y, [x_, *params], grad, allow_unused=True)
        dw = grads[1] if len(grads) > 1 else None
        db = grads[2] if len(grads) > 2 else None
        return grads[0], dw, db, None


def _install_te_norms():
    undo = []
    for cls in (torch.nn.RMSNorm, torch.nn.LayerNorm):
        original = cls.forward

        def forward(self, x, _original=original):
            if getattr(self, "weight", None) is None:
                return _original(self, x)
            return _TENorm.apply(x, self.weight, getattr(self, "bias", None), self)

        undo.append(set_attr(cls, "_planner_forward", original))
        undo.append(set_attr(cls, "forward", forward))

    def restore():
        for u in reversed(undo):
            u()

    return restore


class _FusedRope(torch.autograd.Function):
    """t [s, b, heads, d] rotated by ``freqs`` as megatron's unfused RoPE computes it; saves only
    ``freqs`` (transformer-engine's fused RoPE keeps no activation: the rotation is linear, its
    backward the inverse rotation of the gradient)."""

    @staticmethod
    def forward(ctx, t, freqs, interleaved):
        from megatron.core.models.common.embeddings import rope_utils

        with torch.no_grad():
            out = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
        ctx.save_for_backward(freqs)
        ctx.interleaved = interleaved
        return out

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.models.common.embeddings import rope_utils

        (freqs,) = ctx.saved_tensors
        with torch.enable_grad():
            x = torch.zeros_like(grad, requires_grad=True)  # linear in t: the Jacobian is the same anywhere
            out = rope_utils._apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=ctx.interleaved)
            (dt,) = torch.autograd.grad(out, x, grad)
        return dt, None, None


def _fused_rope(t, freqs, interleaved=False, **_unused):
    return _FusedRope.apply(t, freqs, interleaved)


def _install_fused_rope():
    from megatron.core.models.common.embeddings import rope_utils

    return set_attr(rope_utils, "fused_apply_rotary_pos_emb", _fused_rope)


def _install_fused_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        return _FusedAttention.apply(query, key, value, self.softmax_scale)

    return set_attr(DotProductAttention, "forward", forward)


FUSED_ATTENTION = Patch(
    "planner.fused_attention",
    ["megatron/core/transformer/dot_product_attention.py:142"],
    "planner trace of a transformer-engine run only: core attention keeps what TE's fused attention keeps",
    _install_fused_attention,
)
TE_NORMS = Patch(
    "planner.te_norms",
    ["megatron/core/transformer/torch_norm.py:56"],
    "planner trace of a transformer-engine run only: norms keep what TE's norms keep (input, fp32 statistics)",
    _install_te_norms,
)
FUSED_ROPE = Patch(
    "planner.fused_rope",
    ["megatron/core/models/common/embeddings/rope_utils.py:317"],
    "planner trace of a transformer-engine run with RoPE fusion only: megatron's call of TE's fused "
    "RoPE (absent here) keeps what it keeps (no activation)",
    _install_fused_rope,
)
def _install_te_version():
    from megatron.core import utils
    from packaging.version import Version

    from megatron_ext.seams.te_spec import ASSUMED_TE_VERSION

    return set_attr(utils, "_te_version", Version(ASSUMED_TE_VERSION))


TE_VERSION = Patch(
    "planner.te_version",
    ["megatron/core/utils.py:71", "megatron/core/transformer/transformer_config.py:2173"],
    "planner trace of a transformer-engine run only: megatron's config checks (rotary_interleaved with "
    "apply_rope_fusion needs TE >= 2.3) ask the installed transformer-engine's version; answered for the "
    "cluster's (seams/te_spec.py ASSUMED_TE_VERSION), as FUSED_ROPE stands in for its kernel",
    _install_te_version,
)
SEAMS = [BALANCED_ROUTING, BUFFER_REQUESTS, FUSED_ATTENTION, TE_NORMS, FUSED_ROPE, TE_VERSION]


@contextlib.contextmanager
def balanced_routing():
    with BALANCED_ROUTING.applied():
        yield


@contextlib.contextmanager
def transformer_engine_saves():
    """Core attention, norms and fused RoPE keep for backward what transformer-engine's keep; megatron's
    checks of its version answer for the cluster's."""
    with FUSED_ATTENTION.applied(), TE_NORMS.applied(), FUSED_ROPE.applied(), TE_VERSION.applied():
        yield


@contextlib.contextmanager
def buffer_requests():
    """Yields a list that collects (key, bytes) of every global memory buffer request in the block."""
    seen: list = []
    _REQUESTS.append(seen)
    try:
        with BUFFER_REQUESTS.applied():
            yield seen
    finally:
        _REQUESTS.remove(seen)
