"""The families, as data: for each Hugging Face ``model_type``, the megatron flags its config implies
(``flags(cfg)``) and ONE weight table.

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

from megatron_ext.errors import ConfigError

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

# model types whose architecture is a supported family's, under another name (the published Kimi-K2
# ships transformers' DeepSeek-V3 code as its remote code)
ALIASES = {"kimi_k2": "deepseek_v3"}
SUPPORTED = sorted([*TABLES, *ALIASES])

# what to import instead, for model types that wrap a supported one
INSTEAD = {
    "llama4": "a text-and-vision Llama-4: import its text model alone, a Llama4ForCausalLM (model_type llama4_text)",
}

# config fields that say nothing about the weights or the forward pass
IGNORED = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "output_router_logits", "initializer_range", "return_dict", "output_hidden_states",
    "output_attentions", "tie_encoder_decoder", "is_encoder_decoder", "_name_or_path", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "task_specific_params", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "add_cross_attention", "cross_attention_hidden_size", "is_decoder", "pruned_heads",
    "torchscript", "tf_legacy_loss", "use_bfloat16", "finetuning_task", "max_window_layers",
    "auto_map",  # where remote code lives (the family's table and flags stand for it)
}


class Config:
    """The HF config dict; every field read is recorded, so the unread ones can be refused by name."""

    def __init__(self, raw: dict):
        self.raw, self.read = raw, set()

    def __getitem__(self, key):
        self.read.add(key)
        if key not in self.raw:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return self.raw[key]

    def get(self, key, default=None):
        self.read.add(key)
        return self.raw.get(key, default)

    def expect(self, key, allowed, why: str):
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise refuse(key, value, why)
        return value

    def unread(self) -> list[str]:
        return sorted(k for k in self.raw if k not in self.read and k not in IGNORED)


def refuse(key, value, why: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={value!r}: {why}")


def _rope_parameters(c: Config) -> tuple[dict, int, str]:
    """(the rope parameters not yet read, the base, the rope type): what every family's rope reads
    first; what it leaves is refused by _refuse_unread_rope."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = c["rope_theta"]
    if float(theta) != int(theta):
        raise refuse("rope_theta", theta, "megatron's --rotary-base is an integer")
    return rope, int(theta), rope.pop("rope_type", rope.pop("type", "default"))


def _refuse_unread_rope(rope: dict, kind: str) -> None:
    if rope:
        key = sorted(rope)[0]
        raise refuse(f"rope_parameters.{key}", rope[key], f"not representable for rope_type {kind}")


def _rope(c: Config) -> dict:
    rope, theta, kind = _rope_parameters(c)
    partial = rope.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor") or 1.0
    flags = {"position_embedding_type": "rope", "rotary_base": theta, "rotary_percent": float(partial)}
    if kind == "llama3":
        # megatron's llama-3 scaling (rotary_pos_embedding.py _apply_scaling) takes the factor; the
        # other three are fixed at Llama-3.1's values there, and this project's flags set others
        # (Llama-4-Scout's high_freq_factor 1; the values as seams/architectures.py LLAMA3_ROPE_FLAGS,
        # written here again so that reading a config needs no megatron-core import)
        flags.update(use_rope_scaling=True, rope_scaling_factor=float(rope.pop("factor", 8.0)))
        for key, cast, fixed in (("low_freq_factor", float, 1.0), ("high_freq_factor", float, 4.0),
                                 ("original_max_position_embeddings", int, 8192)):
            value = cast(rope.pop(key, fixed))
            if value != fixed:
                flags[f"rope_scaling_{key}"] = value
    elif kind != "default":
        raise refuse("rope_parameters.rope_type", kind, "supported: default, llama3")
    _refuse_unread_rope(rope, kind)
    return flags


def rope_get(c: Config, key):
    return (c.raw.get("rope_parameters") or c.raw.get("rope_scaling") or {}).get(key)


def _dense(c: Config, layer_types=("full_attention",)) -> dict:
    heads, groups = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    c.expect("hidden_act", ["silu"], "megatron's --swiglu gates with SiLU")
    c.expect("attention_bias", [False], "attention biases are not mapped")
    c.expect("mlp_bias", [False], "MLP biases are not mapped")
    c.expect("pretraining_tp", [1], "only the unsliced projections are mapped")
    c.expect("use_sliding_window", [False], "sliding-window attention is not mapped for this family")
    c.expect("sliding_window", [None], "sliding-window attention is not mapped for this family")
    found = c.get("layer_types")
    if found and set(found) - set(layer_types):
        raise refuse("layer_types", sorted(set(found)), f"supported: {', '.join(layer_types)}")
    flags = {
        "num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
        "ffn_hidden_size": c["intermediate_size"], "num_attention_heads": heads, "kv_channels": head_dim,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "normalization": "RMSNorm", "norm_epsilon": float(c["rms_norm_eps"]), "swiglu": True,
        "disable_bias_linear": True, "max_position_embeddings": c["max_position_embeddings"],
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "attention_dropout": float(c.get("attention_dropout", 0.0)), "hidden_dropout": 0.0,
        "transformer_impl": "local", "rotary_interleaved": False,
    }
    flags.update(_rope(c))
    return flags


def _moe(c: Config, experts_key: str, ffn_key: str, pre_softmax: bool) -> dict:
    flags = {"num_experts": c[experts_key], "moe_router_topk": c["num_experts_per_tok"],
             "moe_ffn_hidden_size": c[ffn_key], "moe_router_score_function": "softmax",
             "moe_router_pre_softmax": pre_softmax, "moe_router_load_balancing_type": "aux_loss",
             "moe_aux_loss_coeff": float(c.get("router_aux_loss_coef", 0.0)),
             "moe_token_dispatcher_type": "alltoall"}
    return flags


def flags(model_type: str, c: Config) -> dict:
    if model_type == "llama":
        return _dense(c)
    if model_type == "qwen3":
        return {**_dense(c), "qk_layernorm": True}
    if model_type == "qwen3_moe":
        out = {**_dense(c), "qk_layernorm": True}
        # HF: norm_topk_prob=False keeps the softmax over all experts (megatron's pre-softmax)
        experts = "num_experts" if "num_experts" in c.raw else "num_local_experts"  # transformers 5 writes the latter
        out.update(_moe(c, experts, "moe_intermediate_size", pre_softmax=not c.get("norm_topk_prob", False)))
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(out["num_layers"])]
        if not all(pattern):
            out["moe_layer_freq"] = "[" + ",".join(map(str, pattern)) + "]"
        return out
    if model_type == "nemotron":
        return _nemotron(c)
    if model_type == "mixtral":
        out = _dense(c)
        c.expect("router_jitter_noise", [0.0, 0], "megatron's --moe-input-jitter-eps is another noise")
        out.update(_moe(c, "num_local_experts", "intermediate_size", pre_softmax=False))
        return out
    if model_type == "deepseek_v3":
        return _deepseek_v3(c)
    if model_type == "deepseek_v2":
        return _deepseek_v2(c)
    if model_type == "gpt_oss":
        return _gpt_oss(c)
    if model_type == "llama4_text":
        return _llama4(c)
    raise ConfigError(f"architecture {model_type} is not supported")


def _deepseek_v3(c: Config) -> dict:
    """DeepSeek-V3 / Kimi-K2: sigmoid scores with a score-correction bias, renormalised top-k, a
    group scored by its top two experts."""
    c.expect("norm_topk_prob", [True], "megatron normalises the top-k sigmoid scores")
    c.get("num_nextn_predict_layers")  # transformers has no MTP layers: their weights, if present, are refused
    topk, groups, group_topk = c["num_experts_per_tok"], c.get("n_group", 1), c.get("topk_group", 1)
    if groups > 1 and topk != 2 * group_topk:
        raise refuse("topk_group", group_topk, "megatron scores a group by its top num_experts_per_tok/topk_group "
                     "experts, transformers by its top 2: they agree when num_experts_per_tok = 2 x topk_group")
    routing = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
    return _mla_moe(c, routing, groups, group_topk)


def _deepseek_v2(c: Config) -> dict:
    """DeepSeek-V2: the softmax over every expert, its top-k kept as they are (megatron's
    pre-softmax), greedy or group-limited (a group scored by its best expert)."""
    c.expect("norm_topk_prob", [False], "transformers' DeepSeek-V2 router keeps the top-k softmax scores unnormalised")
    c.expect("mlp_bias", [False], "MLP biases are not mapped")
    method = c.expect("topk_method", ["greedy", "group_limited_greedy"], "supported: greedy, group_limited_greedy")
    topk, groups, group_topk = c["num_experts_per_tok"], c.get("n_group"), c.get("topk_group")
    if method == "greedy":
        groups = group_topk = 1
    elif topk != group_topk:
        raise refuse("topk_group", group_topk, "megatron scores a group by its top num_experts_per_tok/topk_group "
                     "experts, transformers' group_limited_greedy by its best one: they agree when "
                     "num_experts_per_tok = topk_group")
    routing = {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True}
    return _mla_moe(c, routing, groups, group_topk)


def _mla_moe(c: Config, routing: dict, groups: int, group_topk: int) -> dict:
    """The DeepSeek families' common flags: multi-latent attention (query LoRA where the config has
    a rank), yarn rope, dense first layers, routed and shared experts with ``routing``."""
    heads = c["num_attention_heads"]
    c.expect("hidden_act", ["silu"], "megatron's --swiglu gates with SiLU")
    c.expect("attention_bias", [False], "attention biases are not mapped")
    c.expect("pretraining_tp", [1], "only the unsliced projections are mapped")
    c.expect("rope_interleave", [True], "megatron's multi-latent attention rotates interleaved pairs")
    if c.get("num_key_value_heads", heads) != heads:
        raise refuse("num_key_value_heads", c.raw["num_key_value_heads"], "multi-latent attention has one per head")
    c.get("head_dim"), c.get("qk_head_dim")  # derived: qk_rope_head_dim, qk_nope + qk_rope
    rope, theta, kind = _rope_parameters(c)
    flags = {"rope_type": "rope", "rotary_base": theta}
    if kind == "yarn":
        # megatron's MLA yarn always rounds its correction range (transformers' truncate)
        if rope.pop("truncate", True) is not True:
            raise refuse("rope_parameters.truncate", rope_get(c, "truncate"), "megatron's MLA yarn always truncates")
        flags = {"rope_type": "yarn", "rotary_base": theta, "rotary_scaling_factor": float(rope.pop("factor")),
                 "mscale": float(rope.pop("mscale", 1.0)), "mscale_all_dim": float(rope.pop("mscale_all_dim", 0.0)),
                 "yarn_original_max_position_embeddings": int(rope.pop("original_max_position_embeddings", 4096)),
                 "yarn_beta_fast": float(rope.pop("beta_fast", 32.0)), "yarn_beta_slow": float(rope.pop("beta_slow", 1.0))}
    elif kind != "default":
        raise refuse("rope_parameters.rope_type", kind, "supported: default, yarn")
    _refuse_unread_rope(rope, kind)
    layers, dense = c["num_hidden_layers"], c.get("first_k_dense_replace", 0)
    out = {
        "num_layers": layers, "hidden_size": c["hidden_size"], "ffn_hidden_size": c["intermediate_size"],
        "num_attention_heads": heads, "multi_latent_attention": True,
        "kv_lora_rank": c["kv_lora_rank"], "qk_head_dim": c["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": c["qk_rope_head_dim"], "v_head_dim": c["v_head_dim"], "kv_channels": c["v_head_dim"],
        "qk_layernorm": True, "normalization": "RMSNorm", "norm_epsilon": float(c["rms_norm_eps"]), "swiglu": True,
        "disable_bias_linear": True, "max_position_embeddings": c["max_position_embeddings"],
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "attention_dropout": float(c.get("attention_dropout", 0.0)), "hidden_dropout": 0.0,
        "transformer_impl": "local", "position_embedding_type": "rope", **flags,
        "num_experts": c["n_routed_experts"], "moe_router_topk": c["num_experts_per_tok"], "moe_ffn_hidden_size": c["moe_intermediate_size"],
        **routing,
        "moe_router_topk_scaling_factor": float(c.get("routed_scaling_factor", 1.0)), "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.0,
        "moe_token_dispatcher_type": "alltoall",
    }
    if c.get("q_lora_rank") is not None:
        out["q_lora_rank"] = c["q_lora_rank"]
    else:  # V2-Lite: linear_q_proj on the layer's normalised input, as transformers computes it
        out["mla_q_proj_without_norm"] = True
    if groups > 1:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    if c.get("n_shared_experts"):
        out["moe_shared_expert_intermediate_size"] = c["n_shared_experts"] * c["moe_intermediate_size"]
    if dense:
        out["moe_layer_freq"] = "[" + ",".join("0" if i < dense else "1" for i in range(layers)) + "]"
    return out


def _nemotron(c: Config) -> dict:
    """Nemotron: LayerNorm with biases whose weights are stored zero-centred (transformers'
    LayerNorm1P, megatron's --apply-layernorm-1p: both compute with weight + 1), a squared-ReLU MLP
    without a gate, rope on the first partial_rotary_factor of each head (rotate-half)."""
    heads, groups = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    c.expect("hidden_act", ["relu2"], "megatron's --squared-relu is relu(x)^2")
    c.expect("attention_bias", [False], "attention biases are not mapped")
    c.expect("mlp_bias", [False], "MLP biases are not mapped")
    flags = {
        "num_layers": c["num_hidden_layers"], "hidden_size": c["hidden_size"],
        "ffn_hidden_size": c["intermediate_size"], "num_attention_heads": heads,
        "kv_channels": c.get("head_dim") or c["hidden_size"] // heads,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "normalization": "LayerNorm", "apply_layernorm_1p": True, "norm_epsilon": float(c["norm_eps"]),
        "squared_relu": True, "disable_bias_linear": True, "max_position_embeddings": c["max_position_embeddings"],
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "attention_dropout": float(c.get("attention_dropout", 0.0)), "hidden_dropout": 0.0,
        "transformer_impl": "local", "rotary_interleaved": False,
    }
    flags.update(_rope(c))
    return flags


def _gpt_oss(c: Config) -> dict:
    """gpt-oss: biases on every linear (megatron's default --add-bias-linear), learnable softmax sinks,
    sliding-window attention on the layers `layer_types` names, the clamped GLU of quick-GELU with
    the linear half offset by 1, yarn rope (rotate-half), top-k of the router's logits then a
    softmax over them, experts stacked in one tensor per layer."""
    heads, groups = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    c.expect("hidden_act", ["silu"], "gpt-oss's GLU gates with x * sigmoid(alpha x) (megatron's --quick-geglu)")
    c.expect("attention_bias", [True], "megatron's --add-bias-linear puts a bias on every linear or on none")
    c.expect("swiglu_alpha", [1.702], "megatron's --quick-geglu fixes alpha at 1.702")
    layers = c["num_hidden_layers"]
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise refuse("layer_types", sorted(set(types)), "supported: sliding_attention, full_attention")
    out = {
        "num_layers": layers, "hidden_size": c["hidden_size"], "ffn_hidden_size": c["intermediate_size"],
        "num_attention_heads": heads, "kv_channels": c.get("head_dim") or c["hidden_size"] // heads,
        "group_query_attention": groups != heads, "num_query_groups": groups,
        "normalization": "RMSNorm", "norm_epsilon": float(c["rms_norm_eps"]),
        "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": float(c["swiglu_limit"]),
        "softmax_type": "learnable", "max_position_embeddings": c["max_position_embeddings"],
        "untie_embeddings_and_output_weights": not c.get("tie_word_embeddings", False),
        "attention_dropout": float(c.get("attention_dropout", 0.0)), "hidden_dropout": 0.0,
        "transformer_impl": "local", "rotary_interleaved": False,
        # megatron's fused kernels take neither sinks nor the clamped GLU's bias
        "masked_softmax_fusion": False, "bias_gelu_fusion": False, "bias_dropout_fusion": False,
        "num_experts": c["num_local_experts"], "moe_router_topk": c["num_experts_per_tok"],
        "moe_ffn_hidden_size": c["intermediate_size"], "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(c.get("router_aux_loss_coef", 0.0)), "moe_token_dispatcher_type": "alltoall",
    }
    if "sliding_attention" in types:
        # transformers keeps the sliding_window newest keys (the query's own included); megatron's
        # window (left, 0) keeps left + 1
        out.update(window_size=f"{c['sliding_window'] - 1},0",
                   window_attn_skip_freq="[" + ",".join(str(int(t == "sliding_attention")) for t in types) + "]")
    else:
        c.get("sliding_window")
    out.update(_yarn(c))
    return out


def _yarn(c: Config) -> dict:
    """Rotate-half yarn rope (gpt-oss): megatron's --position-embedding-type yarn with its beta,
    original positions and rounding; the attention factor transformers derives from the factor
    (0.1 ln(factor) + 1) is megatron's with --mscale 1, --mscale-all-dim 0."""
    rope, theta, kind = _rope_parameters(c)
    if kind != "yarn":
        raise refuse("rope_parameters.rope_type", kind, "supported for gpt_oss: yarn")
    flags = {"position_embedding_type": "yarn", "rotary_base": theta, "rotary_percent": 1.0,
             "rotary_scaling_factor": float(rope.pop("factor")),
             "yarn_original_max_position_embeddings": int(rope.pop("original_max_position_embeddings")),
             "yarn_beta_fast": float(rope.pop("beta_fast", 32.0)), "yarn_beta_slow": float(rope.pop("beta_slow", 1.0)),
             "yarn_correction_range_round_to_int": bool(rope.pop("truncate", True))}
    _refuse_unread_rope(rope, kind)
    return flags


def _llama4(c: Config) -> dict:
    """Llama-4 (text): rope on interleaved pairs, skipped on the NoPE layers (no_rope_layers, 1 = rope);
    the parameter-free L2 query/key norm on the rope layers only; dense and MoE layers (moe_layers); top-1
    sigmoid routing whose score scales the expert's input, a shared expert; experts stacked.

    Two of its attention details megatron-core does not implement, and both are the identity up to a
    length, which becomes the recipe's --max-position-embeddings (megatron refuses a longer --seq-length):
    the rope layers attend within chunks of attention_chunk_size tokens (one chunk up to that length), and
    the NoPE layers scale queries by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (1 below
    position floor_scale - 1)."""
    out = _dense(c, layer_types=("full_attention", "chunked_attention"))
    layers = out["num_layers"]
    # the two layer lists, or transformers' defaults from their intervals (Llama4TextConfig.__post_init__)
    interval, step = int(c.get("no_rope_layer_interval", 4)), int(c.get("interleave_moe_layer_step", 1))
    use_rope = [int(x) for x in (c.get("no_rope_layers") or [(i + 1) % interval != 0 for i in range(layers)])]
    moe_layers = c.get("moe_layers")
    moe_layers = set(range(step - 1, layers, step) if moe_layers is None else moe_layers)
    chunk = c.get("attention_chunk_size")
    expected = ["chunked_attention" if r and chunk is not None else "full_attention" for r in use_rope]
    if (c.get("layer_types") or expected) != expected:
        raise refuse("layer_types", c.raw["layer_types"], "Llama-4 chunks the attention of its rope layers, "
                     "and of no other layer")
    limit = out["max_position_embeddings"]
    if "chunked_attention" in expected:
        limit = min(limit, int(chunk))
    if c.get("attn_temperature_tuning", True) and not all(use_rope):
        limit = min(limit, int(c.get("floor_scale", 8192)) - 1)
    c.get("attn_scale")  # any value: the scaling it sets is the identity below the length limit above
    c.expect("router_jitter_noise", [0.0, 0], "megatron's --moe-input-jitter-eps is another noise")
    c.expect("num_experts_per_tok", [1], "megatron scales the expert input by the router score "
             "(--moe-apply-probs-on-input) for top-1 routing only")
    out.update(ffn_hidden_size=c["intermediate_size_mlp"], rotary_interleaved=True, max_position_embeddings=limit,
               num_experts=c["num_local_experts"], moe_router_topk=1, moe_ffn_hidden_size=c["intermediate_size"],
               moe_shared_expert_intermediate_size=c["intermediate_size"], moe_router_score_function="sigmoid",
               moe_apply_probs_on_input=True, moe_router_load_balancing_type="aux_loss",
               moe_aux_loss_coeff=float(c.get("router_aux_loss_coef", 0.0)), moe_token_dispatcher_type="alltoall")
    if len(moe_layers) < layers:
        out["moe_layer_freq"] = "[" + ",".join(str(int(i in moe_layers)) for i in range(layers)) + "]"
    if not all(use_rope):
        out["no_rope_freq"] = "[" + ",".join(str(1 - r) for r in use_rope) + "]"
    if c.get("use_qk_norm", True):
        out["qk_l2_norm"] = True
        if not all(use_rope):
            out["qk_norm_skip_nope_layers"] = True
    return out
