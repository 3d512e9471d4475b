"""Job functions for tests/attention (run on every rank of a persistent gloo world, tests/dist.py)."""
from __future__ import annotations

import torch

# (name, TransformerConfig fields, core-attention kwargs, heads, groups, dk, dv, layer number, mask)
# mask: None, "causal" (the data loader's), "documents" (a packed row's), on a causal layer each
CASES = [
    ("causal", {}, {}, 4, 4, 16, 16, 1, None),
    ("gqa", dict(num_query_groups=2), {}, 4, 2, 16, 16, 1, None),
    ("loader_mask", {}, {}, 4, 4, 16, 16, 1, "causal"),
    ("documents", dict(num_query_groups=2), {}, 4, 2, 16, 16, 1, "documents"),
    ("latent", {}, dict(softmax_scale=0.15, k_channels=24, v_channels=16), 4, 4, 24, 16, 1, None),
    ("layer_scaling", dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True), {}, 4, 4, 16, 16, 3,
     None),
    ("window", dict(window_size=(5, 0)), {}, 4, 4, 16, 16, 1, None),
    ("window_documents", dict(window_size=(5, 0), num_query_groups=2), {}, 4, 2, 16, 16, 1, "documents"),
    ("sinks", dict(softmax_type="learnable", num_query_groups=2), {}, 4, 2, 16, 16, 1, None),
    ("sinks_window_documents", dict(softmax_type="learnable", window_size=(5, 0), num_query_groups=2), {}, 4, 2, 16,
     16, 1, "documents"),
    ("off_by_one", dict(softmax_type="off-by-one"), {}, 4, 4, 16, 16, 1, None),
]
SEQ, BATCH = 24, 2
SEGMENTS = ([0] * 9 + [1] * 11 + [2] * 4, [0] * 15 + [1] * 9)  # per row: conversations, then padding


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def unfused_vs_sdpa() -> dict:
    """Every case: megatron-core's DotProductAttention (unfused; with the packed-mask seam a run with a
    mask has) against TorchCoreAttention, same weights and inputs, fp32: ‖Δ‖/‖ref‖ of the output and of
    every gradient (queries, keys, values, the sinks). Then attention dropout: drawn from the
    model-parallel RNG tracker's stream (the default generator untouched), the same stream twice."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.seams import sft as sft_seams
    from megatron_ext.seams.architectures import LocalLatentAttention
    from megatron_ext.seams.attention import TorchCoreAttention
    from megatron_ext.sft.attention import block_causal_mask
    from megatron_ext.training import parallel

    parallel.initialize()
    out = {}
    try:
        for name, fields, kwargs, heads, groups, dk, dv, layer, mask_kind in CASES:
            config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=heads, kv_channels=16,
                                       attention_dropout=0.0, masked_softmax_fusion=False, **fields)
            build = dict(config=config, layer_number=layer, attn_mask_type=AttnMaskType.causal,
                         attention_type="self", **kwargs)
            reference = (LocalLatentAttention if kwargs else DotProductAttention)(**build)
            torch.manual_seed(11)
            ours = TorchCoreAttention(**build)
            if reference.softmax_offset is not None:
                with torch.no_grad():
                    offset = torch.randn(heads) * 2
                    if isinstance(reference.softmax_offset, torch.nn.Parameter):
                        reference.softmax_offset.copy_(offset)
                        ours.softmax_offset.copy_(offset)
                    else:
                        reference.softmax_offset, ours.softmax_offset = offset.clone(), offset.clone()
            g = torch.Generator().manual_seed(3)
            q = torch.randn(SEQ, BATCH, heads, dk, generator=g)
            k = torch.randn(SEQ, BATCH, groups, dk, generator=g)
            v = torch.randn(SEQ, BATCH, groups, dv, generator=g)
            grad = torch.randn(SEQ, BATCH, heads * dv, generator=g)
            mask = None
            if mask_kind == "causal":
                mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
            elif mask_kind == "documents":
                mask = block_causal_mask(torch.tensor(SEGMENTS))
            results = []
            for module in (reference, ours):
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                with sft_seams.PACKED_CAUSAL_MASK.applied():
                    output = module(*leaves, mask)
                params = [p for p in module.parameters()]
                grads = torch.autograd.grad(output, leaves + params, grad)
                results.append((output.detach(), grads))
            (ref_out, ref_grads), (got_out, got_grads) = results
            out[name] = dict(output=_rel(got_out, ref_out), shape=tuple(got_out.shape) == tuple(ref_out.shape),
                             grads=[_rel(a, b) for a, b in zip(got_grads, ref_grads)],
                             same_keys=sorted(reference.state_dict()) == sorted(ours.state_dict()),
                             keys=sorted(ours.state_dict()))
        out["dropout"] = _dropout(TorchCoreAttention, TransformerConfig, AttnMaskType)
        return out
    finally:
        parallel.destroy()


def _dropout(cls, config_cls, mask_type) -> dict:
    from megatron.core import tensor_parallel

    config = config_cls(num_layers=1, hidden_size=64, num_attention_heads=4, attention_dropout=0.5,
                        masked_softmax_fusion=False)
    module = cls(config=config, layer_number=1, attn_mask_type=mask_type.causal, attention_type="self")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(SEQ, 1, 4, 16, generator=g) for _ in range(3))
    tracker = tensor_parallel.get_cuda_rng_tracker()

    def once():
        tracker.set_states(dict(states))  # set_states keeps the dict it is given: a copy
        before = torch.get_rng_state()
        result = module(q, k, v, None)
        return result, torch.equal(before, torch.get_rng_state())

    states = tracker.get_states()
    first, default_untouched = once()
    second, _ = once()
    module.eval()
    plain = module(q, k, v, None)
    return dict(default_untouched=default_untouched, repeatable=torch.equal(first, second),
                dropped=not torch.allclose(first, plain))


def offload_compare(**kw) -> dict:
    """bench.offload's comparison (offload off vs on, bitwise; bytes offloaded and the peak saving)
    with the local spec's core attention through torch SDPA."""
    from bench import offload as bench

    result = bench.compare(attention="sdpa", **kw)
    from megatron_ext.offload import canonical_modules, theory

    c = result["config"]
    shape = dict(seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"], heads=c["heads"], topk=c["topk"],
                 moe_ffn=c["moe_ffn"], shared_ffn=c["shared"])
    modules = canonical_modules(kw.get("modules", ()))
    result["sdpa_group_bytes"] = theory.group_bytes(modules, c["model"] == "moe", attention="sdpa", **shape)
    result["unfused_group_bytes"] = theory.group_bytes(modules, c["model"] == "moe", **shape)
    per_chunk = c["layers"] // (c["pp"] * (c["vpp"] or 1))
    # at these shapes the logits' gradient outweighs a layer's backward: the step peaks there
    result["sdpa_theoretical_bytes"] = theory.theoretical_saving(
        result["sdpa_group_bytes"], c["pp"], c["vpp"], result["pp_rank"], c["microbatches"], per_chunk,
        kw.get("offload_kw", {}).get("prefetch_depth", 1), peak="loss_backward")
    result.pop("timeline_off", None)
    result.pop("timeline_on", None)
    for run in result["runs"]:
        run.pop("timeline_on", None)
    return result
