"""Where activation offload attaches in megatron-core's modules (nothing of megatron-core is replaced).

megatron_ext.offload.manager attaches torch module hooks to
megatron-core modules and pushes torch's saved-tensor hooks around their forward. The modules it
finds, by the names of the flag --activation-offload-modules:
  pass  (one micro-batch of one chunk): pre-hook on GPTModel      models/gpt/gpt_model.py:519
  group (one layer of one pass): pre/post hooks on TransformerLayer
                                           transformer/transformer_layer.py:304 (forward :747);
    its backward begins when the gradient of the layer's output (:1012, make_viewless_tensor)
    arrives: a Tensor.register_hook on that output.
  core_attention  layer.self_attention.core_attention      transformer/attention.py:382
                  (local: DotProductAttention, transformer/dot_product_attention.py:142, keeping the
                  s x s probabilities; or, --attention-backend auto / flash, torch's attention
                  (megatron_ext/seams/attention.py TorchCoreAttention), keeping queries, keys, values,
                  its output and the log-sum-exp; that output is linear_proj's input, one storage:
                  it counts under core_attention, and moves with attn_proj only when both are listed)
  qkv_linear      layer.self_attention.linear_qkv          transformer/attention.py:1681
                  and the query/key norms of --qk-layernorm (q_layernorm, k_layernorm, :1722);
                  multi-latent attention (MLASelfAttention, transformer/multi_latent_attention.py
                  :644-866): every projection to queries, keys and values: linear_q_proj (no
                  --q-lora-rank) or linear_q_down_proj, q_layernorm, linear_q_up_proj; and
                  linear_kv_down_proj, kv_layernorm, linear_kv_up_proj (none is bypassed: the
                  manager counts what each of them saved and offloaded, module_stats)
  attn_proj       layer.self_attention.linear_proj         transformer/attention.py:413
                  (MLA: the same name, multi_latent_attention.py:220)
  router_fc1      MoE expert fc1: layer.mlp.experts.local_experts[i].linear_fc1 (SequentialMLP,
                  transformer/moe/experts.py:1260; MLP fc1 transformer/mlp.py:222) or
                  layer.mlp.experts.linear_fc1 (TEGroupedMLP, transformer/moe/experts.py:216)
                  or, under --moe-zero-sync-dropless, the grouped linear that replaces the local
                  experts' (megatron_ext/moe/grouped_experts.py)
  router_fc2      the same with linear_fc2 (transformer/mlp.py:242, transformer/moe/experts.py:235)
  moe_act         the expert activation: everything saved between the expert's fc1 returning and
                  its fc2 starting (MLP.forward transformer/mlp.py:267-336, TEGroupedMLP.forward
                  transformer/moe/experts.py:815-876), so fused, GLU and TE activations are all
                  covered without wrapping config.activation_func
  shared_experts  layer.mlp.shared_experts                 transformer/moe/moe_layer.py:338;
                  under --moe-shared-expert-overlap the dispatcher calls its linear_fc1_forward_and_act
                  and linear_fc2_forward instead of its forward (moe_layer.py:345): those calls are wrapped
  dense_mlp       a dense layer's MLP: layer.mlp when it is megatron's MLP (transformer/mlp.py:222-336:
                  linear_fc1, the activation, linear_fc2), not a MoE layer
  refused: expert modules with --use-transformer-engine-op-fuser (offload.validate): the experts then
                  run TE's fused op (TEGroupedMLP._with_fused_impl = the flag, transformer/moe/experts.py:290,
                  taken at :753), which bypasses linear_fc1 / linear_fc2
Module paths are the same in the local and the transformer-engine layer specs.
"""
from __future__ import annotations

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer


def offload_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _expert_linears(experts, which: str) -> list:
    if experts is None:
        return []
    grouped = getattr(experts, "grouped_experts", None)  # --moe-zero-sync-dropless: one grouped linear
    if grouped is not None:
        return [getattr(grouped, which)]
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return [getattr(e, which) for e in experts.local_experts]
    lin = getattr(experts, which, None)
    return [lin] if lin is not None else []


# standard attention, then MLA's (transformer/multi_latent_attention.py MLASelfAttention): absent ones are skipped
_QKV_PROJECTIONS = ("linear_qkv", "q_layernorm", "k_layernorm", "linear_q_proj", "linear_q_down_proj",
                    "linear_q_up_proj", "linear_kv_down_proj", "kv_layernorm", "linear_kv_up_proj")


# --moe-shared-expert-overlap: the dispatcher runs the shared experts through these methods
# (transformer/moe/shared_experts.py:254, 312; called at token_dispatcher.py:710, 865), never their forward
_OVERLAPPED_SHARED_EXPERT_CALLS = ("linear_fc1_forward_and_act", "linear_fc2_forward")


def offload_targets(layer, names) -> list:
    """[(name, "module", [modules])], [(name, "window", [(fc1, fc2)])] or [(name, "calls", [(object,
    method name)])] present in this layer."""
    attn = getattr(layer, "self_attention", None)
    mlp = getattr(layer, "mlp", None)
    experts = getattr(mlp, "experts", None)
    out = []
    for name in names:
        if name == "core_attention":
            mods = [getattr(attn, "core_attention", None)]
        elif name == "qkv_linear":
            mods = [getattr(attn, n, None) for n in _QKV_PROJECTIONS]
        elif name == "attn_proj":
            mods = [getattr(attn, "linear_proj", None)]
        elif name == "router_fc1":
            mods = _expert_linears(experts, "linear_fc1")
        elif name == "router_fc2":
            mods = _expert_linears(experts, "linear_fc2")
        elif name == "shared_experts":
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None and getattr(mlp, "shared_expert_overlap", False):
                # the dispatcher calls these instead of the module (--moe-shared-expert-overlap)
                out.append((name, "calls", [(shared, m) for m in _OVERLAPPED_SHARED_EXPERT_CALLS]))
                continue
            mods = [shared]
        elif name == "dense_mlp":
            mods = [mlp] if isinstance(mlp, MLP) else []
        elif name == "moe_act":
            pairs = list(zip(_expert_linears(experts, "linear_fc1"), _expert_linears(experts, "linear_fc2")))
            if pairs:
                out.append((name, "window", pairs))
            continue
        else:
            raise ValueError(name)
        mods = [m for m in mods if m is not None]
        if mods:
            out.append((name, "module", mods))
    return out
