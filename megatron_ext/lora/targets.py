"""Which linears of a model a LoRA run adapts, named as --lora-target-modules names them.

A module's *target path* is its path in the model with the layer and expert indices dropped and
``experts.local_experts`` shortened to ``experts``: ``decoder.layers.self_attention.linear_qkv``,
``decoder.layers.mlp.linear_fc1`` (a dense MLP), ``decoder.layers.mlp.experts.linear_fc1`` (every routed
expert), ``decoder.layers.mlp.shared_experts.linear_fc1``, ``decoder.layers.mlp.router``,
``mtp.layers.transformer_layer.self_attention.linear_proj``. A target names a module when it is its
target path or a dotted tail of it: ``linear_fc1`` names every fc1 (dense, routed and shared experts),
``experts.linear_fc1`` the routed experts' only, ``mlp.linear_fc1`` the dense MLPs' only.

Nothing here imports megatron-core at import time (argument parsing imports this package).
"""
from __future__ import annotations

import re

# The linears of the local layer spec a target may name (megatron-core's attribute names):
# standard attention, multi-latent attention (transformer/multi_latent_attention.py), the MLP.
ATTENTION = ("linear_qkv", "linear_proj")
MLA = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
MLP = ("linear_fc1", "linear_fc2")
ROUTER = "router"
NAMES = ATTENTION + MLA + MLP + (ROUTER,)
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # the others are column-parallel

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def target_path(module_path: str) -> str:
    """``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1`` -> ``decoder.layers.mlp.experts.linear_fc1``."""
    return _INDEX.sub("", module_path).replace("experts.local_experts", "experts")


def names(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def model_paths(args) -> dict:
    """{target path: (in features, [(part, out features)])} of the linears this run's model has
    (global sizes, canonical parts; the MTP block repeats the decoder's and is left out: a target
    that names a decoder linear names its MTP copy too). From the flags alone, for validation."""
    h = args.hidden_size
    out: dict = {}
    layer = "decoder.layers."
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            out[layer + "self_attention.linear_q_proj"] = (h, [("all", heads * q_head)])
        else:
            out[layer + "self_attention.linear_q_down_proj"] = (h, [("all", args.q_lora_rank)])
            out[layer + "self_attention.linear_q_up_proj"] = (args.q_lora_rank, [("all", heads * q_head)])
        out[layer + "self_attention.linear_kv_down_proj"] = (h, [("all", args.kv_lora_rank + args.qk_pos_emb_head_dim)])
        out[layer + "self_attention.linear_kv_up_proj"] = (
            args.kv_lora_rank, [("all", heads * (args.qk_head_dim + args.v_head_dim))])
        out[layer + "self_attention.linear_proj"] = (heads * args.v_head_dim, [("all", h)])
    else:
        d = args.kv_channels or h // args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        out[layer + "self_attention.linear_qkv"] = (
            h, [("q", args.num_attention_heads * d), ("k", groups * d), ("v", groups * d)])
        out[layer + "self_attention.linear_proj"] = (args.num_attention_heads * d, [("all", h)])

    def mlp(prefix, ffn):
        fc1 = [("gate", ffn), ("up", ffn)] if glu(args) else [("all", ffn)]
        out[prefix + "linear_fc1"] = (h, fc1)
        out[prefix + "linear_fc2"] = (ffn, [("all", h)])

    if dense_layers(args):
        mlp(layer + "mlp.", args.ffn_hidden_size)
    if args.num_experts:
        mlp(layer + "mlp.experts.", args.moe_ffn_hidden_size or args.ffn_hidden_size)
        if args.moe_shared_expert_intermediate_size:
            mlp(layer + "mlp.shared_experts.", args.moe_shared_expert_intermediate_size)
        out[layer + "mlp.router"] = (h, [("all", args.num_experts)])
    return out


def glu(args) -> bool:
    """A gated linear unit: fc1 = [gate; up] (--swiglu, or --quick-geglu as gpt-oss; megatron's config
    builder sets gated_linear_unit for both, training/argument_utils.py:314-325)."""
    return bool(args.swiglu or getattr(args, "quick_geglu", False))


def dense_layers(args) -> bool:
    """Does the decoder have a layer with a dense MLP? (--moe-layer-freq's zeros)"""
    if not args.num_experts:
        return True
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return freq > 1
    return 0 in list(freq)
