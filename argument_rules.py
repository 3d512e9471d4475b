"""What every flag accepts, and the combinations megatron would accept here and fail on later.

Three tables, checked by ``arguments.finalize`` before any compute; docs/flags.md is generated
from them (``python argument_rules.py > docs/flags.md``; a test keeps the page equal to its source):

    DOMAINS   every int/float flag of megatron's parser and ours -> the values it accepts
              (choice flags carry theirs in the parser). A test walks the parser: a flag without
              a domain fails it, so a megatron upgrade that adds flags is caught.
    RULES     cross-field rules, in the order they are checked: parallel layout, model shape,
              batch, schedule, platform (transformer-engine / CUDA), files on disk.
    SITES     megatron's own checks (validate_args, the config __post_init__s) whose condition
              does not name the flags it checks; the rest are mapped by reading the condition.

Every refusal is one line: the flags with their values, then what is allowed.
"""
from __future__ import annotations

import argparse
import ast
import functools
import linecache
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

# ---------------------------------------------------------------------------------------------
# Domains


@dataclass(frozen=True)
class Domain:
    kind: type  # int or float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    also: tuple = ()  # sentinels accepted besides the range, e.g. -1 = "off"
    items: "Domain | None" = None  # for a value given as a list: each element's domain

    def __contains__(self, value) -> bool:
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return False
        return True

    def __str__(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        lo, hi = _num(self.lo), _num(self.hi)
        if self.lo is not None and self.hi is not None:
            text = f"{noun} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"{noun} {'>' if self.lo_open else '>='} {lo}"
        elif self.hi is not None:
            text = f"{noun} {'<' if self.hi_open else '<='} {hi}"
        else:
            text = f"any {'integer' if self.kind is int else 'finite number'}"
        text = " or ".join([*(str(s) for s in self.also), text])
        return f"{text}, or a list of {str(self.items).replace('an integer', 'integers')}" if self.items else text

    def refuses(self, value) -> bool:
        if isinstance(value, (list, tuple)):
            inner = self.items or self
            return any(v not in inner for v in _values(value))
        return value not in self


def _num(x) -> str:
    if x is None:
        return ""
    if float(x).is_integer() and abs(x) >= 2**16:
        return f"2^{int(math.log2(x + 1))} - 1" if (int(x) + 1) & int(x) == 0 else str(int(x))
    return str(int(x)) if float(x).is_integer() else str(x)


@dataclass(frozen=True)
class Family:
    name: str
    domain: Domain
    meaning: str
    flags: tuple[str, ...]


def _family(name: str, domain: Domain, meaning: str, flags: str) -> Family:
    return Family(name, domain, meaning, tuple(flags.split()))


# One family per kind of quantity; a flag belongs to exactly one (a test checks).
FAMILIES = (
    _family("parallel size", Domain(int, 1), "a parallel degree or shard count", """
        tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size
        hierarchical_context_parallel_sizes expert_model_parallel_size expert_tensor_parallel_size
        tensor_parallel_num_weight_shards expert_tensor_parallel_num_weight_shards world_size
        num_layers_per_virtual_pipeline_stage num_virtual_stages_per_pipeline_rank
        microbatch_group_size_per_vp_stage num_distributed_optimizer_instances model_parallel_size
        rl_inference_tensor_model_parallel_size rl_inference_pipeline_model_parallel_size
        rl_inference_expert_model_parallel_size rl_inference_expert_tensor_model_parallel_size
        inprocess_active_world_size replication_factor dist_ckpt_workers fault_injector_num_ranks
    """),
    _family("model size", Domain(int, 1), "a layer, head, width or vocabulary size", """
        num_layers encoder_num_layers decoder_num_layers hidden_size num_attention_heads
        num_query_groups ffn_hidden_size kv_channels decoder_first_pipeline_num_layers
        decoder_last_pipeline_num_layers seq_length encoder_seq_length decoder_seq_length
        max_position_embeddings max_seqlen_per_dp_cp_rank vocab_size padded_vocab_size
        make_vocab_size_divisible_by moe_ffn_hidden_size moe_shared_expert_intermediate_size
        moe_shared_expert_glu_interleave_size moe_mlp_glu_interleave_size moe_latent_size
        moe_router_topk moe_router_num_groups moe_router_group_topk moe_upcycling_granularity
        q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim mrope_section
        dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq
        linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads
        linear_num_value_heads mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads
        mup_base_hidden_size relative_attention_num_buckets relative_attention_max_distance
        rotary_base rotary_seq_len_interpolation_factor yarn_original_max_position_embeddings
        ict_head_size num_classes img_h img_w num_channels patch_dim dino_local_img_size
        dino_head_hidden_size dino_bottleneck_size
    """),
    _family("batch size", Domain(int, 1), "samples per batch, a batch ramp-up, or a number of steps", """
        micro_batch_size global_batch_size eval_micro_batch_size eval_global_batch_size
        rampup_batch_size batch_size train_iters train_samples lr_decay_iters lr_decay_samples
        recompute_num_layers mlp_chunks_for_prefill mlp_chunks_for_training muon_num_ns_steps
        fp8_interval fp8_amax_history_len grpo_prompts_per_step grpo_group_size grpo_iterations
        rl_prompts_per_eval rl_sequence_packing_max_sequences_per_bin indexer_batch_size
        iter_per_epoch inference_max_requests inference_max_seq_length
        inference_dynamic_batching_block_size inference_dynamic_batching_max_requests
        inference_dynamic_batching_max_tokens inference_cuda_graph_max_tokens logits_save_top_k
        logits_save_top_p_min_k logits_load_decode_threads logits_load_prefetch_factor
        max_tokens_to_oom tensorboard_queue_size num_dataset_builder_threads ddp_num_buckets
        ddp_bucket_size suggested_communication_unit_size moe_paged_stash_page_size
        moe_flex_dispatcher_num_sms moe_deepep_num_sms moe_hybridep_num_sms
        moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
        moe_hybridep_num_sms_preprocessing fine_grained_offloading_max_inflight_offloads
        retriever_report_topk_accuracies straggler_minmax_count inprocess_max_iterations
        moe_routing_trace_max_training_iters hysteresis save_keep_last warmup
    """),
    _family("interval", Domain(int, 1), "every N iterations (or minutes)", """
        log_interval save_interval save_params_interval save_activations_interval
        save_tokens_per_expert_interval save_wgrads_interval save_dgrads_interval
        save_retain_interval non_persistent_save_interval eval_interval exit_interval
        exit_duration_in_mins tensorboard_log_interval log_memory_interval
        check_weight_hash_across_dp_replicas_interval gpu_sniff_test_interval train_sync_interval
        adlr_autoresume_interval indexer_log_interval replication_jump
        distributed_timeout_minutes distributed_timeout_seconds_after_init
    """),
    _family("count", Domain(int, 0), "a count where 0 means none (or off), or an index", """
        num_experts mtp_num_layers cpu_offloading_num_layers wgrad_deferral_limit
        num_layers_at_start_in_bf16 num_layers_at_end_in_bf16 fp8_margin vocab_extra_ids
        lr_warmup_iters lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples eval_iters
        num_workers manual_gc_interval cuda_graph_warmup_steps inference_logging_step_interval
        min_offloaded_tensor_size delta_offload_bytes_across_pp_ranks dsa_indexer_skip_topk_offset
        ckpt_step override_ckpt_iteration start_eval_at_iter iterations_to_skip profile_step_start
        profile_step_end profile_ranks local_rank error_injection_rate null_tokenizer_eod_id
        tiktoken_num_special_tokens rl_generation_lag num_speculative_tokens biencoder_projection_dim
        inference_dynamic_batching_cuda_graph_mixed_prefill_count dino_local_crops_number
        dino_warmup_teacher_temp_epochs ft_num_warmup_iters flight_recorder_trace_buffer_size
        fault_injector_delay_start_iteration logits_load_msc_prefetch_depth
        activation_offload_prefetch_depth
    """),
    _family("seed", Domain(int, 0, 2**32 - 1), "a random seed (numpy accepts 0 .. 2^32 - 1)", """
        seed fault_injector_seed
    """),
    _family("off or count", Domain(int, 1, also=(-1,)), "-1 turns it off / lets megatron choose", """
        rl_default_top_k inference_batch_times_seqlen_threshold
        inference_dynamic_batching_num_cuda_graphs
    """),
    _family("token id or none", Domain(int, 0, also=(-1,)), "a token id; -1 = no such token", """
        null_tokenizer_pad_id
    """),
    _family("port", Domain(int, 1, 65535), "a TCP port", """
        straggler_ctrlr_port inference_coordinator_port
    """),
    _family("nice value", Domain(int, 0, 19), "a CPU nice value (higher = lower priority)", """
        async_ckpt_cpu_priority
    """),
    _family("io class", Domain(int, 0, 3), "an I/O scheduling class (3 = idle)", """
        async_ckpt_io_priority
    """),
    _family("logging level", Domain(int, 0, 50), "a Python logging level (10 DEBUG .. 50 CRITICAL)", """
        logging_level
    """),
    _family("probability", Domain(float, 0, 1, hi_open=True), "a dropout or masking probability", """
        hidden_dropout attention_dropout mask_prob short_seq_prob query_in_block_prob
    """),
    _family("fraction", Domain(float, 0, 1), "a fraction or a probability that may be 1", """
        lr_warmup_fraction activation_offload_fraction optimizer_offload_fraction fim_rate
        fim_spm_rate fim_fragment_rate rl_default_top_p logits_load_kd_loss_alpha
        moe_router_quantile_balancing_ema inference_dynamic_batching_prefix_caching_routing_alpha
    """),
    _family("open fraction", Domain(float, 0, 1, lo_open=True), "a share that must not be 0", """
        sample_rate classes_fraction data_per_class_fraction rotary_percent logits_save_top_p
        inference_dynamic_batching_mamba_memory_ratio qk_clip_alpha
    """),
    _family("beta", Domain(float, 0, 1, hi_open=True), "an optimizer moment decay / momentum", """
        adam_beta1 adam_beta2 lion_beta1 lion_beta2 sgd_momentum muon_momentum
    """),
    _family("epsilon", Domain(float, 0, lo_open=True), "an epsilon, standard deviation or clip range", """
        adam_eps layernorm_epsilon dsa_indexer_k_norm_epsilon moe_input_jitter_eps init_method_std
        embedding_init_method_std grpo_clamp_eps_lower grpo_clamp_eps_upper
    """),
    _family("positive", Domain(float, 0, lo_open=True), "a scale, factor, size or duration", """
        mup_width_mult mup_embedding_mult mup_output_mult mup_base_head_dim qk_clip_threshold
        rope_scaling_factor rotary_scaling_factor mscale moe_router_topk_scaling_factor
        moe_expert_capacity_factor moe_expert_rank_capacity_factor moe_dropless_budget_factor loss_scale initial_loss_scale
        min_loss_scale loss_scale_window muon_extra_scale_factor head_lr_mult mask_factor
        dino_warmup_teacher_temp dino_teacher_temp yarn_beta_fast yarn_beta_slow
        rl_default_temperature inference_dynamic_batching_buffer_size_gb
        inprocess_monitor_thread_interval inprocess_monitor_process_interval
        inprocess_progress_watchdog_interval inprocess_heartbeat_interval inprocess_soft_timeout
        inprocess_hard_timeout inprocess_heartbeat_timeout inprocess_barrier_timeout
        inprocess_completion_timeout fault_injector_fault_delay fault_injector_mtti_seconds
        activation_offload_pool_mb activation_offload_chunk_mb plan_memory_gb plan_host_link_gbps
    """),
    _family("non-negative", Domain(float, 0), "a rate, coefficient or amount where 0 means none", """
        lr min_lr decoupled_lr decoupled_min_lr lr_warmup_init weight_decay start_weight_decay
        end_weight_decay clip_grad mtp_loss_scaling_factor moe_aux_loss_coeff moe_z_loss_coeff
        moe_router_bias_update_rate dsa_indexer_loss_coeff grpo_kl_beta grpo_entropy_term_weight
        rl_importance_sampling_truncation_coef activation_func_clamp_value mscale_all_dim
        mup_attn_scale_power mid_level_dataset_surplus dino_freeze_last_layer
        inference_dynamic_batching_paused_buffer_size_gb
        inference_dynamic_batching_prefix_caching_mamba_gb inprocess_last_call_wait
        inprocess_termination_grace_time activation_offload_min_tensor_kb
    """),
    _family("signed", Domain(float), "signed: the sign selects a mode, or an offset", """
        glu_linear_offset moe_router_force_biased moe_paged_stash_buffer_size_factor_cuda
        moe_paged_stash_buffer_size_factor_cpu fault_injector_offset_seconds
    """),
    # Flags whose type parses a pattern (an int N or a Python list); the parser's type refuses
    # malformed text, the pattern's length is checked by megatron against --num-layers.
    _family("layer pattern", Domain(int, 1, items=Domain(int, 0, 1)), "every N-th layer, or a 0/1 per layer", """
        moe_layer_freq window_attn_skip_freq no_rope_freq linear_attention_freq
    """),
    _family("window", Domain(int, -1, items=Domain(int, -1)), "a (left, right) attention window; -1 = unbounded", """
        window_size
    """),
)

# Types that parse a value megatron then checks itself (not numbers): no numeric domain.
PARSED_BY_MEGATRON = ("cuda_graph_modules", "cuda_graph_scope_deprecated")

DOMAINS: dict[str, Family] = {f: fam for fam in FAMILIES for f in fam.flags}


def is_numeric(action) -> bool:
    """Flags that take numbers (int/float, or megatron's own number-or-pattern types)."""
    if action.choices is not None or action.type in (None, str, bool) or not action.option_strings:
        return False
    return action.dest not in PARSED_BY_MEGATRON


def _values(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _values(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


# ---------------------------------------------------------------------------------------------
# The platform a validation is for


def target(args):
    """Is CUDA / transformer-engine / apex there, for this validation: every platform rule asks here.
    The machine running it, or the ``--platform`` target of a ``--dry-run``
    (megatron_ext/platform/target.py)."""
    from megatron_ext.platform.target import resolve

    return resolve(args)


# ---------------------------------------------------------------------------------------------
# Cross-field rules


@dataclass(frozen=True)
class Rule:
    family: str
    flags: tuple[str, ...]  # shown with their values in the refusal
    ok: Callable[[Any], bool]
    allowed: str  # what is allowed (the refusal's text and the docs' rule)
    when: Callable[[Any], bool] = lambda a: True
    stage: str = "given"  # "given": the values as set; "resolved": after megatron's validate_args
    context: tuple[str, ...] = ()  # shown too where they differ from their defaults
    detail: Callable[[Any], str] | None = None  # the numbers behind a refusal, in parentheses


def _tp(a):
    return a.tensor_model_parallel_size


def _etp(a):
    return a.expert_tensor_parallel_size or a.tensor_model_parallel_size


def _model_parallel(a):
    return a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size


def _dp(a):
    return a.world_size // _model_parallel(a)


def _pipeline_layers(a):
    return a.num_layers + a.account_for_embedding_in_pipeline_split + a.account_for_loss_in_pipeline_split


def _uneven(a):
    return a.decoder_first_pipeline_num_layers is not None or a.decoder_last_pipeline_num_layers is not None


def _middle(a):
    """(layers, stages) between the explicitly sized first/last pipeline stages."""
    layers, stages = a.num_layers, a.pipeline_model_parallel_size
    for n in (a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers):
        if n is not None:
            layers, stages = layers - n, stages - 1
    return layers, stages


def _vpp(a):
    return a.num_virtual_stages_per_pipeline_rank


def _grouped_gqa(a):
    return a.num_query_groups if a.group_query_attention else a.num_attention_heads


def _moe(a):
    return bool(a.num_experts)


def _recompute_modules(a):
    return a.recompute_modules or []


def _fp8_or_fp4(a):
    return a.fp8 is not None or a.fp4 is not None


def _exists(path) -> bool:
    return os.path.exists(os.path.expanduser(path))


def _blend_prefixes(paths) -> list[str]:
    """Dataset prefixes of a megatron blend: ``P [P ...]`` or ``W P [W P ...]``."""
    if not paths:
        return []
    items = [p for entry in paths for p in str(entry).split()]
    if len(items) % 2 == 0:
        try:
            [float(w) for w in items[0::2]]
            return items[1::2]
        except ValueError:
            pass
    return items


def _missing_data(paths) -> list[str]:
    return [p for p in _blend_prefixes(paths) if not (_exists(p + ".bin") and _exists(p + ".idx"))]


def _writable_dir(path) -> bool:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _readable_dir(path) -> bool:
    path = os.path.expanduser(path)
    return os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK)


# megatron/core/tokenizers/utils/build_tokenizer.py: the files each tokenizer type reads
_TOKENIZER_NEEDS = {
    ("vocab_file", "merge_file"): ("GPT2BPETokenizer",),
    ("vocab_file",): ("BertWordPieceLowerCase", "BertWordPieceCase"),
    ("tokenizer_model",): ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                           "TikTokenizer", "SFTTokenizer", "HuggingFaceTokenizer"),
}


def _path_like(value: str) -> bool:
    """A HuggingFace tokenizer may be a hub name ('org/name'); a local path starts like one."""
    return value.startswith(("/", "./", "../", "~"))


_ACCOUNT_FOR = ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
_FIRST_LAST = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
_MODEL_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
_LAYER_PATTERNS = ("moe_layer_freq", "no_rope_freq", "linear_attention_freq", "window_attn_skip_freq")


RULES = (
    # --- parallel layout -------------------------------------------------------------------
    Rule("parallel layout", ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                             "context_parallel_size"),
         lambda a: a.world_size % _model_parallel(a) == 0, "the world size must be a multiple of TP x PP x CP",
         detail=lambda a: f"world size ({a.world_size}) is not divisible by {_model_parallel(a)}"),
    Rule("parallel layout", ("world_size", "expert_tensor_parallel_size", "expert_model_parallel_size",
                             "pipeline_model_parallel_size"),
         lambda a: a.world_size % (_etp(a) * a.expert_model_parallel_size * a.pipeline_model_parallel_size) == 0,
         "the world size must be a multiple of expert-TP x EP x PP (expert-TP defaults to TP)"),
    Rule("parallel layout", ("expert_model_parallel_size", "num_experts"),
         lambda a: _moe(a), "expert parallelism needs an MoE model (--num-experts)",
         when=lambda a: a.expert_model_parallel_size > 1),
    Rule("parallel layout", ("num_experts", "expert_model_parallel_size"),
         lambda a: a.num_experts % a.expert_model_parallel_size == 0,
         "EP must divide the number of experts (each EP rank holds num_experts / EP of them)",
         when=_moe),
    Rule("parallel layout", ("num_experts", "tensor_model_parallel_size", "sequence_parallel"),
         lambda a: a.sequence_parallel, "an MoE model with TP > 1 must also use --sequence-parallel "
         "(megatron's MoE layer refuses to train without it)",
         when=lambda a: _moe(a) and a.tensor_model_parallel_size > 1),
    Rule("parallel layout", ("seq_length", "context_parallel_size"),
         lambda a: a.seq_length % (2 * a.context_parallel_size) == 0,
         "with CP > 1 the sequence length must be a multiple of 2 x CP",
         when=lambda a: a.context_parallel_size > 1 and a.seq_length is not None),
    # --- model shape -----------------------------------------------------------------------
    Rule("model shape", ("hidden_size", "num_attention_heads"),
         lambda a: a.hidden_size % a.num_attention_heads == 0,
         "the number of heads must divide the hidden size (or give --kv-channels, the head size)",
         when=lambda a: a.kv_channels is None and a.hidden_size and a.num_attention_heads),
    Rule("model shape", ("num_attention_heads", "num_query_groups"),
         lambda a: a.num_attention_heads % a.num_query_groups == 0,
         "the number of query groups must divide the number of heads",
         when=lambda a: a.group_query_attention and a.num_query_groups and a.num_attention_heads),
    Rule("model shape", ("num_attention_heads", "tensor_model_parallel_size"),
         lambda a: a.num_attention_heads % _tp(a) == 0, "TP must divide the number of attention heads",
         when=lambda a: a.num_attention_heads),
    Rule("model shape", ("num_query_groups", "tensor_model_parallel_size"),
         lambda a: a.num_query_groups % _tp(a) == 0 or _tp(a) % a.num_query_groups == 0,
         "the number of query groups must be a multiple or a divisor of TP",
         when=lambda a: a.group_query_attention and a.num_query_groups),
    Rule("model shape", ("ffn_hidden_size", "tensor_model_parallel_size"),
         lambda a: a.ffn_hidden_size % _tp(a) == 0, "TP must divide the MLP hidden size",
         when=lambda a: a.ffn_hidden_size, stage="resolved"),
    Rule("model shape", ("moe_ffn_hidden_size", "expert_tensor_parallel_size"),
         lambda a: a.moe_ffn_hidden_size % _etp(a) == 0,
         "expert-TP (default: TP) must divide the expert MLP hidden size",
         when=lambda a: _moe(a) and a.moe_ffn_hidden_size, stage="resolved"),
    Rule("model shape", ("moe_router_topk", "num_experts"),
         lambda a: a.moe_router_topk <= a.num_experts, "top-k cannot exceed the number of experts",
         when=_moe),
    Rule("model shape", ("num_experts", "moe_router_num_groups"),
         lambda a: a.num_experts % a.moe_router_num_groups == 0,
         "the router groups must divide the experts into equal groups",
         when=lambda a: _moe(a) and a.moe_router_num_groups),
    Rule("model shape", ("moe_router_group_topk", "moe_router_num_groups"),
         lambda a: a.moe_router_num_groups is not None and a.moe_router_group_topk <= a.moe_router_num_groups,
         "group top-k needs --moe-router-num-groups and cannot exceed it",
         when=lambda a: a.moe_router_group_topk),
    Rule("model shape", ("max_position_embeddings", "seq_length"),
         lambda a: a.max_position_embeddings >= a.seq_length,
         "the sequence length cannot exceed --max-position-embeddings",
         when=lambda a: a.max_position_embeddings and a.seq_length),
    *(Rule("model shape", (dest, "num_layers"), lambda a, d=dest: len(getattr(a, d)) == a.num_layers,
           "a per-layer pattern needs one entry per layer",
           when=lambda a, d=dest: isinstance(getattr(a, d, None), list) and a.num_layers)
      for dest in _LAYER_PATTERNS),
    # --- pipeline split --------------------------------------------------------------------
    Rule("pipeline split", ("num_layers", "pipeline_model_parallel_size"),
         lambda a: _pipeline_layers(a) % a.pipeline_model_parallel_size == 0,
         "PP must divide the layers (+1 for each account-for flag); for an uneven split set "
         "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
         when=lambda a: a.num_layers and not _uneven(a) and a.pipeline_model_parallel_layout is None
         and a.hybrid_layer_pattern is None, context=_ACCOUNT_FOR),
    Rule("pipeline split", ("num_layers", "pipeline_model_parallel_size"),
         lambda a: (_middle(a)[0] == 0) == (_middle(a)[1] == 0) and _middle(a)[0] >= 0
         and (_middle(a)[1] == 0 or _middle(a)[0] % _middle(a)[1] == 0),
         "the layers left after the first/last stages must split evenly over the middle stages "
         "(and there must be middle stages exactly when layers are left)",
         when=lambda a: a.num_layers and _uneven(a) and a.pipeline_model_parallel_layout is None, context=_FIRST_LAST),
    Rule("pipeline split", ("num_layers", "pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank"),
         lambda a: (_pipeline_layers(a) // a.pipeline_model_parallel_size) % _vpp(a) == 0,
         "each pipeline stage's layers must split evenly into the virtual stages",
         when=lambda a: a.num_layers and _vpp(a) and not _uneven(a), context=_ACCOUNT_FOR),
    Rule("pipeline split", ("num_layers", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"),
         lambda a: (_pipeline_layers(a) // a.pipeline_model_parallel_size) % a.num_layers_per_virtual_pipeline_stage == 0,
         "each pipeline stage's layers must split evenly into virtual stages of this many layers",
         when=lambda a: a.num_layers and a.num_layers_per_virtual_pipeline_stage and not _uneven(a),
         context=_ACCOUNT_FOR),
    Rule("pipeline split", ("num_layers", "pipeline_model_parallel_size", "num_virtual_stages_per_pipeline_rank"),
         lambda a: all(n is None or n % _vpp(a) == 0 for n in (a.decoder_first_pipeline_num_layers,
                                                              a.decoder_last_pipeline_num_layers))
         and (_middle(a)[1] == 0 or (_middle(a)[0] // _middle(a)[1]) % _vpp(a) == 0),
         "with virtual stages every pipeline stage's layers must split evenly into them",
         when=lambda a: a.num_layers and _vpp(a) and _uneven(a), context=_FIRST_LAST),
    Rule("pipeline split", ("pipeline_model_parallel_size",),
         lambda a: a.pipeline_model_parallel_size > 1, "sizing the first/last pipeline stage needs PP > 1",
         when=_uneven, context=_FIRST_LAST),
    # --- batch -----------------------------------------------------------------------------
    Rule("batch", ("global_batch_size", "micro_batch_size", "world_size"),
         lambda a: a.global_batch_size % (a.micro_batch_size * _dp(a)) == 0,
         "the global batch must be a multiple of micro batch x data-parallel size",
         detail=lambda a: f"{a.micro_batch_size} x {_dp(a)} = {a.micro_batch_size * _dp(a)}",
         when=lambda a: a.global_batch_size and a.micro_batch_size and a.world_size % _model_parallel(a) == 0,
         context=_MODEL_PARALLEL),
    Rule("batch", ("eval_global_batch_size", "eval_micro_batch_size", "world_size"),
         lambda a: a.eval_global_batch_size % ((a.eval_micro_batch_size or a.micro_batch_size) * _dp(a)) == 0,
         "the eval global batch must be a multiple of eval micro batch x data-parallel size",
         when=lambda a: a.eval_global_batch_size and a.micro_batch_size and a.world_size % _model_parallel(a) == 0,
         context=_MODEL_PARALLEL),
    # --- schedule and precision --------------------------------------------------------------
    Rule("schedule", ("min_lr", "lr"), lambda a: a.min_lr <= a.lr, "--min-lr cannot exceed --lr",
         when=lambda a: a.lr is not None),
    Rule("schedule", ("start_weight_decay", "end_weight_decay", "weight_decay_incr_style"),
         lambda a: a.start_weight_decay is None and a.end_weight_decay is None,
         "with a constant weight decay use --weight-decay; start/end are for linear or cosine",
         when=lambda a: a.weight_decay_incr_style == "constant"),
    Rule("schedule", ("start_weight_decay", "end_weight_decay", "weight_decay_incr_style"),
         lambda a: a.start_weight_decay is not None and a.end_weight_decay is not None,
         "a weight-decay schedule needs both --start-weight-decay and --end-weight-decay",
         when=lambda a: a.weight_decay_incr_style != "constant"),
    Rule("schedule", ("save", "save_interval"), lambda a: a.save_interval is not None,
         "--save needs --save-interval", when=lambda a: a.save),
    Rule("schedule", ("save_retain_interval", "save_interval"),
         lambda a: a.save_interval and a.save_retain_interval % a.save_interval == 0,
         "--save-retain-interval must be a multiple of --save-interval",
         when=lambda a: a.save_retain_interval),
    Rule("schedule", ("log_memory_interval", "log_interval"),
         lambda a: a.log_memory_interval % a.log_interval == 0,
         "--log-memory-interval must be a multiple of --log-interval", when=lambda a: a.log_memory_interval),
    Rule("precision", ("fp16", "bf16"), lambda a: not (a.fp16 and a.bf16), "choose one of --fp16 and --bf16"),
    # --- platform: what transformer-engine / CUDA / apex provide (see target()) -----------------
    Rule("platform", ("fp8", "transformer_impl"),
         lambda a: a.transformer_impl == "transformer_engine" and target(a).te,
         "FP8 runs in transformer-engine kernels: needs --transformer-impl transformer_engine with "
         "transformer-engine installed (the local implementation would silently train in high precision)",
         when=lambda a: a.fp8 is not None),
    Rule("platform", ("fp4", "transformer_impl"),
         lambda a: a.transformer_impl == "transformer_engine" and target(a).te,
         "FP4 runs in transformer-engine kernels: needs --transformer-impl transformer_engine with "
         "transformer-engine installed", when=lambda a: a.fp4 is not None),
    Rule("platform", ("moe_permute_fusion", "transformer_impl"), lambda a: target(a).te,
         "the fused permutation is a transformer-engine kernel (transformer-engine >= 2.1)",
         when=lambda a: a.moe_permute_fusion),
    Rule("platform", ("recompute_modules", "transformer_impl"),
         lambda a: a.transformer_impl == "transformer_engine" and target(a).te,
         "recomputing the layernorm (--recompute-modules layernorm) needs transformer-engine",
         when=lambda a: (a.recompute_granularity == "selective" or a.recompute_activations)
         and "layernorm" in _recompute_modules(a)),
    Rule("platform", ("log_memory_to_tensorboard",), lambda a: target(a).cuda,
         "the CUDA caching allocator's statistics (torch.cuda.memory_stats)",
         when=lambda a: a.log_memory_to_tensorboard),
    Rule("platform", ("nccl_ub",), lambda a: target(a).cuda,
         "NCCL user-buffer registration: buffers from an NCCL memory pool (CUDA + NCCL)",
         when=lambda a: a.nccl_ub),
    Rule("platform", ("moe_grouped_gemm",), lambda a: target(a).cuda,
         "the grouped GEMM kernels need a CUDA GPU (compute capability >= 8.0)",
         when=lambda a: a.moe_grouped_gemm),
    # --- files on disk ----------------------------------------------------------------------
    *(Rule("files", (dest,), lambda a, d=dest: not _missing_data(getattr(a, d)),
           "each dataset prefix needs PREFIX.bin and PREFIX.idx (scripts/prepare_data.py writes them)",
           detail=lambda a, d=dest: "not found: " + ", ".join(_missing_data(getattr(a, d))),
           when=lambda a, d=dest: getattr(a, d) and not a.mock_data)
      for dest in ("data_path", "train_data_path", "valid_data_path", "test_data_path")),
    *(Rule("files", (dest,), lambda a, d=dest: _exists(getattr(a, d)), "no such file",
           when=lambda a, d=dest: getattr(a, d, None))
      for dest in ("data_args_path", "per_split_data_args_path")),
    *(Rule("files", ("tokenizer_type", *needs), lambda a, n=needs: all(getattr(a, d) for d in n),
           f"this tokenizer reads {' and '.join('--' + d.replace('_', '-') for d in needs)}",
           when=lambda a, t=types: a.tokenizer_type in t)
      for needs, types in _TOKENIZER_NEEDS.items()),
    *(Rule("files", (dest,), lambda a, d=dest: _exists(getattr(a, d)), "no such file",
           when=lambda a, d=dest: getattr(a, d, None) and not (
               d == "tokenizer_model" and a.tokenizer_type == "HuggingFaceTokenizer"
               and not _path_like(a.tokenizer_model)))
      for dest in ("vocab_file", "merge_file", "tokenizer_model", "metadata_path")),
    Rule("files", ("save",), lambda a: _writable_dir(a.save),
         "--save must be a directory this user can create or write", when=lambda a: a.save),
    Rule("files", ("load",), lambda a: _readable_dir(a.load) or not _exists(a.load),
         "--load must be a readable directory", when=lambda a: a.load),
    Rule("files", ("load", "save"), lambda a: _exists(a.load) or (a.save and os.path.abspath(a.load) == os.path.abspath(a.save)),
         "--load does not exist (it may be missing only when it is also --save: a first run that "
         "resumes later)", when=lambda a: a.load and not a.exit_on_missing_checkpoint),
    Rule("files", ("pretrained_checkpoint",), lambda a: _readable_dir(a.pretrained_checkpoint),
         "--pretrained-checkpoint must be a readable directory", when=lambda a: getattr(a, "pretrained_checkpoint", None)),
)


# ---------------------------------------------------------------------------------------------
# Checking


def flag_of(parser_actions: dict, dest: str) -> str:
    action = parser_actions.get(dest)
    if action is None:
        return "--" + dest.replace("_", "-")
    longs = [s for s in action.option_strings if s.startswith("--")]
    return longs[0] if longs else dest


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value)


def name_of(parser_actions: dict, dest: str) -> str:
    """The name a refusal shows: the flag, except for a store_false flag (``--no-rope-fusion``),
    shown by its dest (``apply_rope_fusion``, the recipe key) since the flag means the opposite."""
    if isinstance(parser_actions.get(dest), argparse._StoreFalseAction):
        return dest
    return flag_of(parser_actions, dest)


def describe(args, dests, names: Callable[[str], str]) -> str:
    """``--flag=value`` for each dest."""
    return ", ".join(f"{names(d)}={_show(getattr(args, d, None))}" for d in dests)


def check_domains(args, actions: dict) -> str | None:
    """The first flag whose value is outside its domain, as a refusal line."""
    for dest, fam in DOMAINS.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, str):
            continue
        if fam.domain.refuses(value):
            return f"{flag_of(actions, dest)}={_show(value)}: must be {fam.domain} ({fam.name})"
    return None


def check_rules(args, actions: dict, stage: str) -> str | None:
    """The first cross-field rule the arguments break, as a refusal line."""
    for rule in RULES:
        if rule.stage != stage or not rule.when(args):
            continue
        if not rule.ok(args):
            allowed = rule.allowed + (f" ({rule.detail(args)})" if rule.detail else "")
            set_context = [d for d in rule.context if getattr(args, d, None) != actions[d].default]
            if rule.family == "platform" and "transformer-engine" in rule.allowed and not target(args).declared:
                from megatron_ext.platform.target import CLUSTER_HINT

                allowed += "; " + CLUSTER_HINT.format(hint="--assume-te")
            return f"{describe(args, (*rule.flags, *set_context), functools.partial(name_of, actions))}: {allowed}"
    return None


# ---------------------------------------------------------------------------------------------
# megatron's own checks -> the flags they check

MEGATRON_ROOT = None


def _megatron_root() -> str:
    global MEGATRON_ROOT
    if MEGATRON_ROOT is None:
        import megatron

        MEGATRON_ROOT = os.path.dirname(os.path.abspath(list(megatron.__path__)[0]))
    return MEGATRON_ROOT


# Names in megatron's conditions that are not parser flags (config fields, derived args) -> flags.
FIELD_FLAGS = {
    "num_moe_experts": ("num_experts",),
    "transformer_pipeline_model_parallel_size": ("pipeline_model_parallel_size",),
    "data_parallel_size": ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "context_parallel_size"),
    "persist_layer_norm": ("no_persist_layer_norm",),
    "num_layers_in_first_pipeline_stage": ("decoder_first_pipeline_num_layers",),
    "num_layers_in_last_pipeline_stage": ("decoder_last_pipeline_num_layers",),
    "fp8_param": ("fp8_param_gather",),
    "fp4_param": ("fp4_param_gather",),
    "pipeline_dtype": ("bf16", "fp16"),
    "params_dtype": ("bf16", "fp16"),
    "autocast_dtype": ("bf16", "fp16"),
    "batch_p2p_comm": ("overlap_p2p_comm",),
    "gated_linear_unit": ("swiglu",),
    "activation_func": ("swiglu", "squared_relu", "quick_geglu"),
    "bias_activation_fusion": ("bias_swiglu_fusion", "bias_gelu_fusion"),
    "use_custom_fsdp": ("use_megatron_fsdp",),
    "use_dist_ckpt": ("ckpt_format",),
    "virtual_pipeline_model_parallel_size": ("num_layers_per_virtual_pipeline_stage",
                                             "num_virtual_stages_per_pipeline_rank"),
    "gtp_weight_remat_size": ("tensor_parallel_num_weight_shards",),
    "expert_gtp_weight_remat_size": ("expert_tensor_parallel_num_weight_shards",),
    "inference_sampling_seed": ("seed",),
    "is_hybrid_model": ("hybrid_layer_pattern",),
    "use_kitchen": ("kitchen_config_file", "kitchen_recipe_number"),
    "quant_recipe": ("kitchen_config_file", "kitchen_recipe_number", "te_precision_config_file"),
    "rotary_interleaved": ("rotary_interleaved",),
    "use_layer_wise_distributed_optimizer": ("optimizer", "use_distributed_optimizer"),
    "grpo_samples_per_iteration": ("grpo_prompts_per_step", "grpo_group_size"),
    "mtp_standalone": ("pipeline_model_parallel_layout",),
    # DistributedDataParallelConfig (megatron/training/training.py get_megatron_ddp_config)
    "grad_reduce_in_fp32": ("accumulate_allreduce_grads_in_fp32",),
    "check_for_nan_in_grad": ("check_for_nan_in_loss_and_grad",),
    "num_buckets": ("ddp_num_buckets",),
    "bucket_size": ("ddp_bucket_size",),
    "pad_buckets_for_high_nccl_busbw": ("ddp_pad_buckets_for_high_nccl_busbw",),
    "reduce_scatter_with_fp32_accumulation": ("ddp_reduce_scatter_with_fp32_accumulation",),
    "param_name_patterns_for_fp32_local_accumulation": ("ddp_param_name_patterns_for_fp32_local_accumulation",),
    "average_in_collective": ("ddp_average_in_collective",),
    "megatron_fsdp_use_decoupled_grad": ("use_precision_aware_optimizer",),
}

# megatron checks whose condition names a local variable or a version probe, by the condition's
# source text (stable across line moves) -> the flags that lead there.
SITES = {
    "dc[0] >= 8": ("moe_grouped_gemm",),
    "num_layers % args.transformer_pipeline_model_parallel_size == 0": (
        "num_layers", "pipeline_model_parallel_size", "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split"),
    "num_layers_per_pipeline_stage % args.num_layers_per_virtual_pipeline_stage == 0": (
        "num_layers", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage"),
    "num_stages % args.pipeline_model_parallel_size == 0": (
        "pipeline_model_parallel_layout", "pipeline_model_parallel_size"),
    "hybrid_pipeline_segments % args.transformer_pipeline_model_parallel_size == 0": (
        "hybrid_layer_pattern", "pipeline_model_parallel_size"),
    "num_generated_samples_per_inference_iteration % args.global_batch_size == 0": (
        "grpo_prompts_per_step", "grpo_group_size", "grpo_iterations", "global_batch_size"),
    "args.exit_interval % num_training_iterations_per_inference_iteration == 0": (
        "exit_interval", "grpo_prompts_per_step", "grpo_group_size", "global_batch_size"),
    "args.save_interval % num_training_iterations_per_inference_iteration == 0": (
        "save_interval", "grpo_prompts_per_step", "grpo_group_size", "global_batch_size"),
    "all((token is not None for token in extra_tokens))": (
        "fim_prefix_token", "fim_middle_token", "fim_suffix_token", "fim_pad_token", "fim_eod_token"),
}

# Config fields that mean the opposite of the flag they come from.
INVERTED = {"persist_layer_norm", "batch_p2p_comm"}

_OWNERS = ("args", "self", "config")


def _names(node) -> list[str]:
    """``args.X`` / ``self.X`` / ``config.X`` / ``self.config.X`` attribute names in a condition."""
    names = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            owner = sub.value
            if isinstance(owner, ast.Attribute) and owner.attr == "config":
                owner = ast.Name(id="config")
            if isinstance(owner, ast.Name) and owner.id in _OWNERS and sub.attr not in names:
                names.append(sub.attr)
    return names


@functools.lru_cache(maxsize=64)
def _tree(filename: str):
    lines = linecache.getlines(filename)
    if not lines:
        return None
    tree = ast.parse("".join(lines))
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]
    return tree


@functools.lru_cache(maxsize=64)
def _statements(filename: str) -> dict:
    """line -> the innermost statement spanning it (functions and classes excluded)."""
    tree = _tree(filename)
    at: dict = {}
    if tree is None:
        return at
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.stmt)
             and not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    for node in sorted(nodes, key=lambda n: n.lineno):  # stable: a child after its parent
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            at[line] = node
    return at


def site(filename: str, lineno: int):
    """(statement, [conditions leading to it]) at filename:lineno. A line inside an ``if``'s
    condition (a call there raised) counts that condition first."""
    best = _statements(filename).get(lineno)
    if best is None:
        return None, []
    tests, node = [], best
    if isinstance(best, (ast.If, ast.While)) and lineno <= (best.test.end_lineno or best.test.lineno):
        tests.append(best.test)
    while hasattr(node, "parent"):
        parent = node.parent
        if isinstance(parent, ast.If):
            tests.append(parent.test)
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            break
        node = parent
    return best, tests


def site_flags(stmt, tests, dests: set) -> list[str]:
    """The parser flags (dests) a megatron check is about: its own condition first, then the
    conditions that lead to it."""
    found: list[str] = []

    def add(names):
        for name in names:
            for d in (FIELD_FLAGS.get(name, (name,)) if name not in dests else (name,)):
                if d in dests and d not in found:
                    found.append(d)

    if isinstance(stmt, ast.Assert):
        add(SITES.get(ast.unparse(stmt.test), ()))
        add(_names(stmt.test))
    elif stmt is not None and not isinstance(stmt, (ast.Raise, ast.If, ast.While, ast.For, ast.With, ast.Try)):
        add(_names(stmt))
    for test in tests:
        add(SITES.get(ast.unparse(test), ()))
        add(_names(test))
    return found


def _spelled(name: str, flags: Callable[[str], str], dests: set) -> str:
    """How a name in megatron's condition or message is shown: a dest as its flag (a store_false
    one as its dest, the recipe key: its flag means the opposite); a config field renamed from one
    flag as that flag; any other field as it is."""
    if name in dests:
        return flags(name)
    mapped = FIELD_FLAGS.get(name, ())
    if len(mapped) == 1 and name not in INVERTED:
        return flags(mapped[0])
    return name


def render(expr_source: str, flags: Callable[[str], str], dests: set) -> str:
    """megatron's condition with ``args.X`` / ``self.X`` written as the flags."""
    return re.sub(r"\b(?:self\.config|args|self|config)\.(\w+)", lambda m: _spelled(m.group(1), flags, dests),
                  expr_source)


def flagify(message: str, flags: Callable[[str], str], dests: set) -> str:
    """A megatron message with the names of flags/config fields written as the flags."""
    message = re.sub(r"\b(?:self\.config|args|self|config)\.(?=\w)", "", message)
    return re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", lambda m: _spelled(m.group(0), flags, dests), message)


def explain(exc: BaseException, args, actions: dict, *, strict: bool = False) -> str | None:
    """One refusal line for an exception megatron raised from a check on the flags, or None when
    the exception cannot be traced to flags (then it is a bug and keeps its traceback).
    ``strict``: only an ``assert``/``raise`` in megatron's own code counts (used after parsing,
    where an error raised deeper, in torch, is more likely a bug than a flag)."""
    root = _megatron_root()
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    inner = [t for t in frames if os.path.abspath(t.tb_frame.f_code.co_filename).startswith(root + os.sep)]
    if not inner:
        return None
    if strict and inner[-1] is not frames[-1]:
        return None
    dests = set(actions)
    flags = functools.partial(name_of, actions)
    scheduler = _scheduler_mismatch(inner[-1], args, flags)
    if scheduler:
        return scheduler
    # innermost megatron frame first; outward (not strict) until a frame's check names flags
    for frame in reversed(inner if not strict else inner[-1:]):
        filename, lineno = frame.tb_frame.f_code.co_filename, frame.tb_lineno
        stmt, tests = site(filename, lineno)
        if strict and not isinstance(stmt, (ast.Assert, ast.Raise)):
            return None
        found = site_flags(stmt, tests, dests)
        if found:
            break
    else:
        return None
    where = f"{os.path.relpath(filename, root)}:{lineno}"
    shown = describe(args, found, flags) if args is not None else ", ".join(map(flags, found))
    message = str(exc).strip()
    if message:
        message = flagify(message, flags, dests)
    elif isinstance(stmt, ast.Assert):
        message = "megatron requires " + render(ast.unparse(stmt.test), flags, dests)
    else:
        message = type(exc).__name__
    return f"{shown}: {message} ({where})"


_SCHEDULER_FLAGS = {  # OptimizerParamScheduler.load_state_dict names -> the flags behind them
    "learning rate": ("lr",),
    "minimum learning rate": ("min_lr",),
    "warmup iterations": ("lr_warmup_iters", "lr_warmup_fraction", "lr_warmup_samples"),
    "total number of iterations": ("lr_decay_iters", "train_iters", "lr_decay_samples", "train_samples"),
    "learning rate decay style": ("lr_decay_style",),
    "start weight decay": ("start_weight_decay", "weight_decay"),
    "end weight decay": ("end_weight_decay", "weight_decay"),
    "total number of weight decay iterations": ("train_iters", "train_samples"),
    "weight decay incr style": ("weight_decay_incr_style",),
}


def _scheduler_mismatch(tb, args, flags) -> str | None:
    code = tb.tb_frame.f_code
    if code.co_name != "_check_and_set" or "optimizer_param_scheduler" not in code.co_filename:
        return None
    local = tb.tb_frame.f_locals
    dests = [d for d in _SCHEDULER_FLAGS.get(local.get("name"), ()) if args is None or getattr(args, d, None) is not None]
    shown = describe(args, dests, flags) if args is not None else ", ".join(map(flags, dests))
    return (f"{shown}: the checkpoint under --load was saved with {local.get('name')} "
            f"{local.get('sd_value')}, these flags give {local.get('cls_value')}; pass "
            "--override-opt_param-scheduler to use the flags' value or --use-checkpoint-opt_param-scheduler "
            "to keep the checkpoint's")


# ---------------------------------------------------------------------------------------------
# docs/flags.md


def markdown(parser) -> str:
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    flags = functools.partial(flag_of, actions)
    out = [
        "# Flags: what each accepts",
        "",
        "Generated from `argument_rules.py` by `python argument_rules.py > docs/flags.md` (a test keeps",
        "this page equal to its source). `train.py --dry-run` refuses a value outside its domain or a",
        "combination below before any compute, as one line naming the flags, their values and what is",
        "allowed. A flag left unset (no default) is not checked.",
        "",
        "## Numeric flags, by family",
        "",
        "| family | allowed | meaning | flags |",
        "|---|---|---|---|",
    ]
    for fam in FAMILIES:
        names = ", ".join(f"`{flags(d)}`" for d in sorted(fam.flags, key=flags))
        out.append(f"| {fam.name} | {fam.domain} | {fam.meaning} | {names} |")
    out += ["", "## Cross-field rules, in the order they are checked", "",
            "| # | family | flags | rule |", "|---|---|---|---|"]
    for i, rule in enumerate(RULES, 1):
        stage = " (after megatron's defaults)" if rule.stage == "resolved" else ""
        names = ", ".join(f"`{flags(d)}`" for d in (*rule.flags, *rule.context))
        out.append(f"| {i} | {rule.family}{stage} | {names} | {rule.allowed} |")
    out += ["", "Platform rules ask `argument_rules.target(args)`: the machine running the check, or the",
            "target a `--dry-run` names with `--platform cuda [--assume-te | --assume-no-te] [--assume-apex]`.", "",
            "## Choice flags", "", "| flag | choices |", "|---|---|"]
    for dest, action in sorted(actions.items(), key=lambda kv: flags(kv[0])):
        if action.choices is not None and action.option_strings:
            choices = ", ".join(f"`{c}`" for c in (str(getattr(c, "name", c)) for c in action.choices))
            out.append(f"| `{flags(dest)}` | {choices} |")
    out += ["", "## megatron's own checks", "",
            "megatron's `validate_args` and the config classes' `__post_init__` check more; each such",
            "check is reported with the flags its condition reads (config fields are mapped back to",
            "their flags). These conditions name no flag directly and are mapped by their source text:",
            "", "| condition | flags |", "|---|---|"]
    for condition, dests in SITES.items():
        out.append(f"| `{condition}` | {', '.join(f'`{flags(d)}`' for d in dests)} |")
    out += ["", "| config field | flags |", "|---|---|"]
    for name, dests in FIELD_FLAGS.items():
        out.append(f"| `{name}` | {', '.join(f'`{flags(d)}`' for d in dests)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    from megatron_ext import platform

    platform.setup()  # megatron.training.arguments needs the Python 3.11 backfill
    import arguments

    sys.stdout.write(markdown(arguments.build_parser()))


if __name__ == "__main__":
    main()
