"""The Hugging Face config of a model trained from a recipe (no import behind it, so no config.json to
write back): the family whose config represents the run's architecture exactly, or a one-line refusal.

Each candidate family's config is written from the run's flags (``CONFIGS``), then read back the way an
import reads it (families.py ``flags``): the flags that config implies, over megatron's defaults, must
give the run's value of every property that shapes the forward pass (``PROPERTIES``). The first family
for which all agree is the one written. Where none does, the refusal names the first property that
differs for the closest family (the fewest differences), the closest family, and what else differs."""
from __future__ import annotations

import argparse

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "nemotron": "NemotronForCausalLM"}

# The properties compared, in the order a refusal names them: what kind of model, then its sizes.
# Each counts only where it applies (_applies): the dense MLP's width where a layer is dense, the
# router's details where there are experts, the rotary details where positions rotate.
PROPERTIES = (
    "normalization", "layernorm_zero_centered_gamma", "swiglu", "squared_relu", "quick_geglu", "glu_linear_offset",
    "activation_func_clamp_value", "add_bias_linear", "add_qkv_bias", "apply_residual_connection_post_layernorm",
    "position_embedding_type", "multi_latent_attention", "qk_layernorm", "qk_l2_norm", "softmax_type", "window_size",
    "window_attn_skip_freq", "attention_output_gate", "mtp_num_layers", "no_rope_freq",
    "num_experts", "moe_layer_freq", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_apply_probs_on_input", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk",
    "rope_type", "rotary_interleaved", "rotary_percent", "use_rope_scaling", "rotary_base", "rope_scaling_factor",
    "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings",
    "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_correction_range_round_to_int", "mla_q_proj_without_norm",
    "num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "layernorm_epsilon", "untie_embeddings_and_output_weights",
)
# what a family's flags set that is not the model's forward: training, kernels, the layer spec
NOT_COMPARED = {"attention_dropout", "hidden_dropout", "transformer_impl", "moe_aux_loss_coeff",
                "moe_router_load_balancing_type", "moe_token_dispatcher_type", "moe_router_dtype",
                "masked_softmax_fusion", "bias_gelu_fusion", "bias_dropout_fusion", "max_position_embeddings",
                "group_query_attention", "qk_norm_skip_nope_layers"}
_ROTARY = {"rotary_interleaved", "rotary_percent", "use_rope_scaling", "rotary_base"}
_LLAMA3 = {"rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
           "rope_scaling_original_max_position_embeddings"}
# megatron-core's fixed llama-3 values, where the flag is not given (seams/architectures.py LLAMA3_ROPE_FLAGS)
_LLAMA3_FIXED = {"rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                 "rope_scaling_original_max_position_embeddings": 8192}
# megatron-core's multi-latent attention yarn defaults, where the flag is not given (MLATransformerConfig)
_YARN_DEFAULTS = {"mscale": 1.0, "mscale_all_dim": 0.0, "yarn_original_max_position_embeddings": 4096,
                  "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
_YARN = {"rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
         "yarn_beta_fast", "yarn_beta_slow", "yarn_correction_range_round_to_int"}
_MLA = {"rope_type", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"}


def hf_config(args, load: str) -> tuple[str, families.Config]:
    """(model type, config) of the run's model: the first family that represents it exactly; else one
    line naming the first property that differs for the closest family."""
    parser = _parser()
    defaults = {a.dest: a.default for a in parser._actions}
    tried = []
    for model_type, write in CONFIGS.items():
        raw = write(args)
        try:
            implied = _implied(model_type, raw, parser)
        except ConfigError as e:  # the family reads this config as no model at all (a router it cannot group)
            tried.append((model_type, [str(e)]))
            continue
        differ = _differences(args, argparse.Namespace(**{**defaults, **implied}))
        if not differ:
            return model_type, families.Config(raw)
        tried.append((model_type, differ))
    # the closest: the fewest differences in the properties that decide the others (a dense family
    # compares no router), then the fewest in all; the first of them in CONFIGS' order
    closest, differ = min(tried, key=lambda t: (sum(isinstance(d, str) or _flag(d[0]) in _DECIDING for d in t[1]),
                                                len(t[1])))
    if isinstance(differ[0], str):
        raise ConfigError(f"--load={load}: no Hugging Face family represents this model (the closest, {closest}, "
                          f"reads its config as: {differ[0]})")
    (flag, ours, theirs), *rest = differ
    also = f" and differs in {', '.join(f'{f}={o}' for f, o, _ in rest)}" if rest else ""
    raise ConfigError(f"--load={load}: no Hugging Face family represents this model's {flag}={ours}: the closest, "
                      f"{closest}, has {theirs}{also}")


_PARSER: list = []  # built once per process (megatron's add_megatron_arguments takes a while)


def _parser():
    """megatron's flags and this project's, as the run's parser declares them (their defaults and
    how a recipe's key becomes a value)."""
    if not _PARSER:
        from megatron.training.arguments import add_megatron_arguments

        from megatron_ext.training import features

        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_megatron_arguments(parser)
        features.add_arguments(parser)
        _PARSER.append(parser)
    return _PARSER[0]


def _implied(model_type: str, raw: dict, parser) -> dict:
    """The run's values (by dest) the config implies, as an import of it would set them."""
    from megatron_ext.config import recipes

    c = families.Config(raw)
    flags = families.flags(model_type, c)
    unread = [k for k in c.unread() if k != "vocab_size"]  # the embedding's rows: the import reads them
    assert not unread, (model_type, unread)  # a config field written here that the family's reader ignores
    return recipes.resolve(flags, parser, f"the {model_type} config")


# the properties that decide which others apply: compared wherever either side has them
_DECIDING = {"position_embedding_type", "multi_latent_attention", "num_experts", "use_rope_scaling",
             "moe_router_num_groups"}


def _differences(run, family) -> list[tuple[str, str, str]]:
    """(flag, the run's value, the family's) for each property the family's config does not give."""
    out = []
    for dest in PROPERTIES:
        if dest in _DECIDING or (_applies(run, dest) and _applies(family, dest)):
            ours, theirs = _value(run, dest), _value(family, dest)
            if ours != theirs:
                out.append((f"--{dest.replace('_', '-')}", _shown(ours), _shown(theirs)))
    return out


def _flag(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _shown(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _experts(ns) -> bool:
    return bool(ns.num_experts)


def _pattern(ns) -> list[int]:
    """Which layers are MoE layers (1), as megatron reads --moe-layer-freq."""
    if not ns.num_experts:
        return [0] * ns.num_layers
    freq = ns.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(ns.num_layers)]
    return [int(x) for x in freq]


def _applies(ns, dest: str) -> bool:
    mla = ns.multi_latent_attention
    rotary = ns.position_embedding_type in ("rope", "yarn") or mla
    if dest == "ffn_hidden_size":
        return 0 in _pattern(ns)
    if dest.startswith("moe_"):
        return _experts(ns) and (dest != "moe_router_group_topk" or (ns.moe_router_num_groups or 1) > 1)
    if dest in _ROTARY:
        return rotary
    if dest in _LLAMA3:
        return rotary and ns.use_rope_scaling
    if dest in _YARN:
        return ns.position_embedding_type == "yarn" or (mla and ns.rope_type == "yarn")
    if dest in _MLA:
        return mla
    if dest == "mla_q_proj_without_norm":
        return mla and ns.q_lora_rank is None
    if dest in ("num_query_groups", "kv_channels"):
        return not mla
    return True


def _value(ns, dest: str):
    if not _applies(ns, dest) and dest not in _DECIDING:
        return None
    if dest == "num_query_groups":
        return ns.num_query_groups if ns.group_query_attention else ns.num_attention_heads
    if dest == "kv_channels":
        return ns.kv_channels or ns.hidden_size // ns.num_attention_heads
    if dest == "moe_layer_freq":
        return _pattern(ns)
    if dest == "moe_ffn_hidden_size":
        return ns.moe_ffn_hidden_size or ns.ffn_hidden_size
    if dest == "moe_router_topk_scaling_factor":
        return float(ns.moe_router_topk_scaling_factor or 1.0)
    if dest == "moe_router_num_groups":
        return ns.moe_router_num_groups or 1
    if dest == "moe_shared_expert_intermediate_size":
        return ns.moe_shared_expert_intermediate_size or 0
    if dest == "rope_type":
        return ns.rope_type or "yarn"  # megatron's MLA default
    value = vars(ns).get(dest)  # a property megatron's flags lack in this version is at its default
    if value is None and dest in _LLAMA3_FIXED:
        return _LLAMA3_FIXED[dest]
    if value is None and dest in _YARN_DEFAULTS:
        return _YARN_DEFAULTS[dest]
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, float) and value == int(value) and dest not in ("layernorm_epsilon",):
        return float(value)
    return value


# ---------------------------------------------------------------------------------------------
# each candidate family's config.json, written from the run's flags
# ---------------------------------------------------------------------------------------------
def _common(a, model_type: str) -> dict:
    raw = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
           "hidden_size": a.hidden_size, "num_hidden_layers": a.num_layers,
           "num_attention_heads": a.num_attention_heads, "max_position_embeddings": a.max_position_embeddings,
           "vocab_size": a.padded_vocab_size, "tie_word_embeddings": not a.untie_embeddings_and_output_weights,
           "attention_dropout": 0.0, "attention_bias": False, "hidden_act": "silu",
           "dtype": "bfloat16" if a.bf16 else "float16" if a.fp16 else "float32"}
    return raw


def _rope(a) -> dict:
    rope = {"rope_type": "default", "rope_theta": float(a.rotary_base)}
    if a.use_rope_scaling:
        rope.update(rope_type="llama3", factor=float(a.rope_scaling_factor),
                    low_freq_factor=float(_value(a, "rope_scaling_low_freq_factor")),
                    high_freq_factor=float(_value(a, "rope_scaling_high_freq_factor")),
                    original_max_position_embeddings=int(_value(a, "rope_scaling_original_max_position_embeddings")))
    return rope


def _groups(a) -> int:
    return a.num_query_groups if a.group_query_attention else a.num_attention_heads


def _gqa(a, model_type: str) -> dict:
    return {**_common(a, model_type), "num_key_value_heads": _groups(a),
            "head_dim": a.kv_channels or a.hidden_size // a.num_attention_heads,
            "rms_norm_eps": a.layernorm_epsilon, "rope_parameters": _rope(a)}


def _llama(a) -> dict:
    return {**_gqa(a, "llama"), "intermediate_size": a.ffn_hidden_size, "mlp_bias": False, "pretraining_tp": 1}


def _qwen3(a) -> dict:
    return {**_gqa(a, "qwen3"), "intermediate_size": a.ffn_hidden_size, "use_sliding_window": False,
            "sliding_window": None}


def _mixtral(a) -> dict:
    return {**_gqa(a, "mixtral"), "intermediate_size": a.moe_ffn_hidden_size or a.ffn_hidden_size,
            "num_local_experts": a.num_experts or 0, "num_experts_per_tok": a.moe_router_topk,
            "router_jitter_noise": 0.0, "router_aux_loss_coef": float(a.moe_aux_loss_coeff or 0.0),
            "sliding_window": None}


def _qwen3_moe(a) -> dict:
    pattern = _pattern(a)
    return {**_gqa(a, "qwen3_moe"), "intermediate_size": a.ffn_hidden_size,
            "moe_intermediate_size": a.moe_ffn_hidden_size or a.ffn_hidden_size, "num_experts": a.num_experts or 0,
            "num_experts_per_tok": a.moe_router_topk, "norm_topk_prob": not a.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe],
            "router_aux_loss_coef": float(a.moe_aux_loss_coeff or 0.0), "use_sliding_window": False,
            "sliding_window": None}


def _deepseek_v3(a) -> dict:
    pattern = _pattern(a)
    dense = next((i for i, moe in enumerate(pattern) if moe), len(pattern))
    moe_ffn = a.moe_ffn_hidden_size or a.ffn_hidden_size
    rope = {"rope_type": "default", "rope_theta": float(a.rotary_base)}
    if a.multi_latent_attention and _value(a, "rope_type") == "yarn":
        rope.update(rope_type="yarn", factor=float(a.rotary_scaling_factor), mscale=float(_value(a, "mscale")),
                    mscale_all_dim=float(_value(a, "mscale_all_dim")),
                    original_max_position_embeddings=int(_value(a, "yarn_original_max_position_embeddings")),
                    beta_fast=float(_value(a, "yarn_beta_fast")), beta_slow=float(_value(a, "yarn_beta_slow")))
    return {**_common(a, "deepseek_v3"), "num_key_value_heads": a.num_attention_heads,
            "intermediate_size": a.ffn_hidden_size, "moe_intermediate_size": moe_ffn,
            "n_routed_experts": a.num_experts or 0, "num_experts_per_tok": a.moe_router_topk,
            "n_shared_experts": (a.moe_shared_expert_intermediate_size or 0) // moe_ffn,
            "routed_scaling_factor": float(a.moe_router_topk_scaling_factor or 1.0),
            "n_group": a.moe_router_num_groups or 1, "topk_group": a.moe_router_group_topk or 1,
            "norm_topk_prob": True, "first_k_dense_replace": dense, "kv_lora_rank": a.kv_lora_rank,
            "q_lora_rank": a.q_lora_rank, "qk_nope_head_dim": a.qk_head_dim, "qk_rope_head_dim": a.qk_pos_emb_head_dim,
            "v_head_dim": a.v_head_dim, "rms_norm_eps": a.layernorm_epsilon, "rope_interleave": True,
            "rope_parameters": rope, "pretraining_tp": 1}


def _nemotron(a) -> dict:
    raw = {**_common(a, "nemotron"), "num_key_value_heads": _groups(a),
           "head_dim": a.kv_channels or a.hidden_size // a.num_attention_heads, "intermediate_size": a.ffn_hidden_size,
           "hidden_act": "relu2", "norm_eps": a.layernorm_epsilon, "mlp_bias": False,
           "rope_parameters": {"rope_type": "default", "rope_theta": float(a.rotary_base)}}
    raw["partial_rotary_factor"] = float(a.rotary_percent)
    return raw


# the candidates, in the order they are tried (and a tie for the closest is broken)
CONFIGS = {"llama": _llama, "qwen3": _qwen3, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe,
           "deepseek_v3": _deepseek_v3, "nemotron": _nemotron}
