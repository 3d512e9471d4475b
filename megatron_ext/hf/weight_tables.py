"""The families' weight tables, as data: for each Hugging Face ``model_type`` ONE table that maps its
weights to megatron-core's (families.py: the flags its config implies; table.py: a table filled in
for one model, and its transforms).

A table row is ``(megatron name, [HF names], transform)``: ``{L}`` is the layer index (HF
``model.layers.L`` = megatron ``decoder.layers.L``), ``{E}`` the expert index. Names are those of
megatron-core's *local* spec (``--transformer-impl local``), as the unwrapped GPTModel's state dict
holds them and as the torch_dist checkpoint keys them. Transforms (import direction; export inverts):

  copy   the tensor as it is
  qkv    q [heads*d, h], k [groups*d, h], v [groups*d, h] -> linear_qkv, interleaved by GQA group:
         for each group its heads/groups query heads, then its key head, then its value head
  glu    gate [f, h], up [f, h] -> linear_fc1 = cat(gate, up) (megatron's --swiglu: first half is gated)

A row whose megatron name has {E} and whose HF names do not is *stacked*: one HF tensor holds every
expert on its first dimension (gpt-oss, Llama-4), and the row fills all the experts' megatron tensors at once:

  stacked_glu_t   [E, h, 2f], gate and up interleaved on the last dimension (gate at even columns,
                  transposed against nn.Linear) -> each expert's linear_fc1 [2f, h] = cat(gate, up)
  stacked_glu     [E, 2f], interleaved the same way -> each expert's linear_fc1 bias [2f]
  stacked_t       [E, in, out] (transposed against nn.Linear) -> each expert's [out, in]: gpt-oss's
                  down projection; Llama-4's gate_up [E, h, 2f] (gate then up) and down [E, f, h]
  stacked         [E, ...] -> each expert's tensor [...]

Only rows whose megatron name the built model has are used (tied embeddings have no output_layer,
a dense layer of a MoE model has no router); every model parameter must come from a row, every HF
tensor must go into one.
"""
from __future__ import annotations

L = "model.layers.{L}."
M = "decoder.layers.{L}."

_EMBEDDING = [
    ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], "copy"),
    ("decoder.final_layernorm.weight", ["model.norm.weight"], "copy"),
    ("output_layer.weight", ["lm_head.weight"], "copy"),  # untied only: tied models have neither
]
_ATTENTION = [
    (M + "input_layernorm.weight", [L + "input_layernorm.weight"], "copy"),
    (M + "self_attention.linear_qkv.weight",
     [L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"], "qkv"),
    (M + "self_attention.linear_proj.weight", [L + "self_attn.o_proj.weight"], "copy"),
    (M + "pre_mlp_layernorm.weight", [L + "post_attention_layernorm.weight"], "copy"),
]
_QK_NORM = [  # per-head RMSNorm of queries and keys, before rope (Qwen3)
    (M + "self_attention.q_layernorm.weight", [L + "self_attn.q_norm.weight"], "copy"),
    (M + "self_attention.k_layernorm.weight", [L + "self_attn.k_norm.weight"], "copy"),
]
_DENSE_MLP = [
    (M + "mlp.linear_fc1.weight", [L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"], "glu"),
    (M + "mlp.linear_fc2.weight", [L + "mlp.down_proj.weight"], "copy"),
]
_E = M + "mlp.experts.local_experts.{E}."

_DEEPSEEK = _EMBEDDING + [  # MLA (query LoRA: the q down/up rows; else q_proj); dense first layers, routed + shared experts
    (M + "input_layernorm.weight", [L + "input_layernorm.weight"], "copy"),
    (M + "self_attention.linear_q_proj.weight", [L + "self_attn.q_proj.weight"], "copy"),
    (M + "self_attention.linear_q_down_proj.weight", [L + "self_attn.q_a_proj.weight"], "copy"),
    (M + "self_attention.q_layernorm.weight", [L + "self_attn.q_a_layernorm.weight"], "copy"),
    (M + "self_attention.linear_q_up_proj.weight", [L + "self_attn.q_b_proj.weight"], "copy"),
    (M + "self_attention.linear_kv_down_proj.weight", [L + "self_attn.kv_a_proj_with_mqa.weight"], "copy"),
    (M + "self_attention.kv_layernorm.weight", [L + "self_attn.kv_a_layernorm.weight"], "copy"),
    (M + "self_attention.linear_kv_up_proj.weight", [L + "self_attn.kv_b_proj.weight"], "copy"),
    (M + "self_attention.linear_proj.weight", [L + "self_attn.o_proj.weight"], "copy"),
    (M + "pre_mlp_layernorm.weight", [L + "post_attention_layernorm.weight"], "copy"),
    *_DENSE_MLP,  # the first_k_dense_replace layers
    (M + "mlp.router.weight", [L + "mlp.gate.weight"], "copy"),
    (M + "mlp.router.expert_bias", [L + "mlp.gate.e_score_correction_bias"], "copy"),
    (_E + "linear_fc1.weight", [L + "mlp.experts.{E}.gate_proj.weight", L + "mlp.experts.{E}.up_proj.weight"], "glu"),
    (_E + "linear_fc2.weight", [L + "mlp.experts.{E}.down_proj.weight"], "copy"),
    (M + "mlp.shared_experts.linear_fc1.weight",
     [L + "mlp.shared_experts.gate_proj.weight", L + "mlp.shared_experts.up_proj.weight"], "glu"),
    (M + "mlp.shared_experts.linear_fc2.weight", [L + "mlp.shared_experts.down_proj.weight"], "copy"),
]

TABLES = {
    "llama": _EMBEDDING + _ATTENTION + _DENSE_MLP,
    "qwen3": _EMBEDDING + _ATTENTION + _QK_NORM + _DENSE_MLP,
    "qwen3_moe": _EMBEDDING + _ATTENTION + _QK_NORM + _DENSE_MLP + [  # dense rows: mlp_only_layers
        (M + "mlp.router.weight", [L + "mlp.gate.weight"], "copy"),
        (_E + "linear_fc1.weight", [L + "mlp.experts.{E}.gate_proj.weight", L + "mlp.experts.{E}.up_proj.weight"], "glu"),
        (_E + "linear_fc2.weight", [L + "mlp.experts.{E}.down_proj.weight"], "copy"),
    ],
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v2": [row for row in _DEEPSEEK if not row[0].endswith("expert_bias")],  # softmax scores
    "gpt_oss": _EMBEDDING + _ATTENTION + [  # biases on every linear, attention sinks, stacked experts
        (M + "self_attention.linear_qkv.bias",
         [L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"], "qkv"),
        (M + "self_attention.linear_proj.bias", [L + "self_attn.o_proj.bias"], "copy"),
        (M + "self_attention.core_attention.softmax_offset", [L + "self_attn.sinks"], "copy"),
        (M + "mlp.router.weight", [L + "mlp.router.weight"], "copy"),
        (M + "mlp.router.bias", [L + "mlp.router.bias"], "copy"),
        (_E + "linear_fc1.weight", [L + "mlp.experts.gate_up_proj"], "stacked_glu_t"),
        (_E + "linear_fc1.bias", [L + "mlp.experts.gate_up_proj_bias"], "stacked_glu"),
        (_E + "linear_fc2.weight", [L + "mlp.experts.down_proj"], "stacked_t"),
        (_E + "linear_fc2.bias", [L + "mlp.experts.down_proj_bias"], "stacked"),
    ],
    "nemotron": _EMBEDDING + _ATTENTION + [  # LayerNorm with biases (weights stored zero-centred), squared ReLU
        ("decoder.final_layernorm.bias", ["model.norm.bias"], "copy"),
        (M + "input_layernorm.bias", [L + "input_layernorm.bias"], "copy"),
        (M + "pre_mlp_layernorm.bias", [L + "post_attention_layernorm.bias"], "copy"),
        (M + "mlp.linear_fc1.weight", [L + "mlp.up_proj.weight"], "copy"),
        (M + "mlp.linear_fc2.weight", [L + "mlp.down_proj.weight"], "copy"),
    ],
    "llama4_text": _EMBEDDING + _ATTENTION + [  # dense and MoE layers; experts stacked, one shared expert
        (M + "mlp.linear_fc1.weight", [L + "feed_forward.gate_proj.weight", L + "feed_forward.up_proj.weight"], "glu"),
        (M + "mlp.linear_fc2.weight", [L + "feed_forward.down_proj.weight"], "copy"),
        (M + "mlp.router.weight", [L + "feed_forward.router.weight"], "copy"),
        (_E + "linear_fc1.weight", [L + "feed_forward.experts.gate_up_proj"], "stacked_t"),
        (_E + "linear_fc2.weight", [L + "feed_forward.experts.down_proj"], "stacked_t"),
        (M + "mlp.shared_experts.linear_fc1.weight",
         [L + "feed_forward.shared_expert.gate_proj.weight", L + "feed_forward.shared_expert.up_proj.weight"], "glu"),
        (M + "mlp.shared_experts.linear_fc2.weight", [L + "feed_forward.shared_expert.down_proj.weight"], "copy"),
    ],
    "mixtral": _EMBEDDING + _ATTENTION + [
        (M + "mlp.router.weight", [L + "block_sparse_moe.gate.weight"], "copy"),
        (_E + "linear_fc1.weight",
         [L + "block_sparse_moe.experts.{E}.w1.weight", L + "block_sparse_moe.experts.{E}.w3.weight"], "glu"),
        (_E + "linear_fc2.weight", [L + "block_sparse_moe.experts.{E}.w2.weight"], "copy"),
    ],
}
