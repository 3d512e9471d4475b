"""The families: for each Hugging Face ``model_type`` supported (SUPPORTED, ALIASES; INSTEAD for the
types that wrap one), the megatron flags its config implies (``flags(model_type, cfg)``), each field
read through config_json.Config so that what no family reads is refused by name. Each family's weight
table: weight_tables.py.
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError
from megatron_ext.hf.config_json import Config, refuse, refuse_unread_rope, rope_get, rope_parameters
from megatron_ext.hf.weight_tables import TABLES

# model types whose architecture is a supported family's, under another name (the published Kimi-K2
# ships transformers' DeepSeek-V3 code as its remote code)
ALIASES = {"kimi_k2": "deepseek_v3"}
SUPPORTED = sorted([*TABLES, *ALIASES])

# what to import instead, for model types that wrap a supported one
INSTEAD = {
    "llama4": "a text-and-vision Llama-4: import its text model alone, a Llama4ForCausalLM (model_type llama4_text)",
}


def _rope(c: Config) -> dict:
    rope, theta, kind = rope_parameters(c)
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
    refuse_unread_rope(rope, kind)
    return flags


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
    rope, theta, kind = rope_parameters(c)
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
    refuse_unread_rope(rope, kind)
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
    rope, theta, kind = rope_parameters(c)
    if kind != "yarn":
        raise refuse("rope_parameters.rope_type", kind, "supported for gpt_oss: yarn")
    flags = {"position_embedding_type": "yarn", "rotary_base": theta, "rotary_percent": 1.0,
             "rotary_scaling_factor": float(rope.pop("factor")),
             "yarn_original_max_position_embeddings": int(rope.pop("original_max_position_embeddings")),
             "yarn_beta_fast": float(rope.pop("beta_fast", 32.0)), "yarn_beta_slow": float(rope.pop("beta_slow", 1.0)),
             "yarn_correction_range_round_to_int": bool(rope.pop("truncate", True))}
    refuse_unread_rope(rope, kind)
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
