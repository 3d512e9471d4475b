"""Tiny random Hugging Face models of every supported family, made offline with transformers' own
config classes, each with its non-default details (tied embeddings, llama-3 rope scaling, GQA,
qk-norm, dense layers among MoE layers, unnormalised top-k, ...) and random norms."""
from __future__ import annotations

import json
import os

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=640, rms_norm_eps=1e-5,
               max_position_embeddings=16384)

_DEEPSEEK_V3 = dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_key_value_heads=4,
                    n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32,
                    q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4,
                    topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})

FAMILIES = {
    # Llama-3.2: tied embeddings, llama3 rope scaling with factor 32
    "llama": dict(intermediate_size=96, num_hidden_layers=2, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    # Qwen3: untied, head dim 32 != hidden / heads, qk-norm
    "qwen3": dict(intermediate_size=96, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3-MoE: 4 experts top-2, the softmax over all experts kept (norm_topk_prob False), layer 0 dense
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=3, head_dim=16, mlp_only_layers=[0], norm_topk_prob=False,
                      tie_word_embeddings=False),
    # DeepSeek-V3: MLA with query LoRA, yarn rope (factor 40, mscale 1.0 / 1.0), a dense first layer, 8 routed
    # experts top-4 in 4 groups (top-2 groups) with sigmoid scores, a score-correction bias and scaling 2.5,
    # one shared expert
    "deepseek_v3": _DEEPSEEK_V3,
    # DeepSeek-V2: MLA with query LoRA, yarn (factor 40, mscale 0.707 / 0.707), a dense first layer, the softmax
    # over 8 experts with its top-2 in 4 groups of which 2 are kept (group-limited greedy) unnormalised and
    # scaled by 2, two shared experts
    "deepseek_v2": dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_key_value_heads=4,
                        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.0, kv_lora_rank=32,
                        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=2,
                        first_k_dense_replace=1, norm_topk_prob=False,
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # DeepSeek-V2-Lite: no query LoRA, greedy top-2 of 4 experts, one shared expert, default rope
    "deepseek_v2_lite": dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                             num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, kv_lora_rank=32,
                             q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                             topk_method="greedy", num_experts_per_tok=2, first_k_dense_replace=1,
                             norm_topk_prob=False, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # Kimi-K2 (DeepSeek-V3's architecture under model_type kimi_k2, its code remote): one expert group, yarn
    # with beta_fast = beta_slow = 1 and factor 32, scaling 2.827
    "kimi_k2": dict(_DEEPSEEK_V3, routed_scaling_factor=2.827, n_group=1, topk_group=1, num_experts_per_tok=2,
                    rope_parameters=dict(_DEEPSEEK_V3["rope_parameters"], rope_theta=50000.0, factor=32.0,
                                         beta_fast=1.0)),
    # gpt-oss: biases everywhere, sinks, a 4-token sliding window on the even layers, experts stacked in
    # one tensor (gate and up interleaved), the GLU clamped low enough to clip, yarn without truncation
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    head_dim=16, sliding_window=4, swiglu_limit=0.1, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 512}),
    # Nemotron: zero-centred LayerNorm with biases, squared ReLU, rope on half of each head, GQA
    "nemotron": dict(intermediate_size=96, num_hidden_layers=2, head_dim=16, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # Llama-4: dense and MoE layers interleaved (4 experts, top-1 sigmoid on the expert input, a shared
    # expert, stacked), NoPE on a dense and a MoE layer with the L2 query/key norm on the others only,
    # interleaved rope with Llama-4-Scout's llama-3 scaling (factor 16, high_freq_factor 1)
    "llama4_text": dict(intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                        num_hidden_layers=4, head_dim=16, interleave_moe_layer_step=2, no_rope_layers=[0, 1, 1, 0],
                        tie_word_embeddings=False,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                         "original_max_position_embeddings": 8192}),
    # Mixtral: 4 experts top-2, renormalised
    "mixtral": dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                    tie_word_embeddings=False),
}
MODEL_TYPE = {"deepseek_v2_lite": "deepseek_v2", "kimi_k2": "deepseek_v3"}  # transformers' class of each
REMOTE = {"kimi_k2"}  # model types transformers knows only through the checkpoint's remote code
IDS = [3, 17, 100, 5, 599, 42, 7, 300, 1, 2, 250, 60]


def make(root, family: str, shard_size: str = "40KB") -> str:
    """The HF directory of a tiny random `family` model under `root` (several shards and an index)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tests.training import local_tokenizers

    root = str(root)
    tok_dir = os.path.join(root, "tok")
    if not os.path.isdir(os.path.join(tok_dir, "hf")):
        os.makedirs(tok_dir, exist_ok=True)
        local_tokenizers.make(tok_dir)  # 600 ids
    out = os.path.join(root, family)
    torch.manual_seed(7)
    fields = {**_COMMON, **FAMILIES[family]}
    if family == "nemotron":  # its LayerNorm's epsilon field
        fields["norm_eps"] = fields.pop("rms_norm_eps")
    config = AutoConfig.for_model(MODEL_TYPE.get(family, family), **fields)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their initial ones, biases and sinks away from 0
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "e_score_correction_bias" in name or name.endswith(("bias", "sinks")):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size=shard_size)
    if family in REMOTE:  # as published: its own model_type, the config and model classes named in auto_map
        with open(os.path.join(out, "config.json")) as f:
            raw = json.load(f)
        raw.update(model_type=family, auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
    AutoTokenizer.from_pretrained(os.path.join(tok_dir, "hf")).save_pretrained(out)
    return out


def load_hf(hf_dir: str, **kwargs):
    """AutoModelForCausalLM.from_pretrained; for a remote-code model type, with the config class its
    remote code names (transformers' own, offline)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(hf_dir, "config.json")) as f:
        raw = json.load(f)
    if raw["model_type"] in REMOTE:
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
        kwargs["config"] = AutoConfig.for_model(MODEL_TYPE[raw["model_type"]], **fields)
    return AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)


def hf_logits(hf_dir: str, ids=IDS):
    """transformers' forward in fp32 on CPU: [seq, vocab]."""
    import torch

    model = load_hf(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_close(ours, ref):
    """cosine >= 0.9999 at every position, max |diff| <= 1e-3 of the largest logit, same argmax."""
    import torch

    ours = torch.as_tensor(ours)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert cos.min() >= 0.9999, cos
    assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
