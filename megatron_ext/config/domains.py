"""DOMAINS: every int/float flag of megatron's parser and ours -> the values it accepts (choice flags
carry theirs in the parser). A test walks the parser: a flag without a domain fails it, so a megatron
upgrade that adds flags is caught."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ext.config.naming import flag_of, show


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
        rope_scaling_original_max_position_embeddings ict_head_size num_classes img_h img_w num_channels patch_dim dino_local_img_size
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
        moe_routing_trace_max_training_iters hysteresis warmup
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
        moe_expert_capacity_factor moe_expert_rank_capacity_factor loss_scale initial_loss_scale
        min_loss_scale loss_scale_window muon_extra_scale_factor head_lr_mult mask_factor
        dino_warmup_teacher_temp dino_teacher_temp yarn_beta_fast yarn_beta_slow
        rope_scaling_low_freq_factor rope_scaling_high_freq_factor
        rl_default_temperature inference_dynamic_batching_buffer_size_gb
        inprocess_monitor_thread_interval inprocess_monitor_process_interval
        inprocess_progress_watchdog_interval inprocess_heartbeat_interval inprocess_soft_timeout
        inprocess_hard_timeout inprocess_heartbeat_timeout inprocess_barrier_timeout
        inprocess_completion_timeout fault_injector_fault_delay fault_injector_mtti_seconds
    """),
    _family("non-negative", Domain(float, 0), "a rate, coefficient or amount where 0 means none", """
        lr min_lr decoupled_lr decoupled_min_lr lr_warmup_init weight_decay start_weight_decay
        end_weight_decay clip_grad mtp_loss_scaling_factor moe_aux_loss_coeff moe_z_loss_coeff
        moe_router_bias_update_rate dsa_indexer_loss_coeff grpo_kl_beta grpo_entropy_term_weight
        rl_importance_sampling_truncation_coef activation_func_clamp_value mscale_all_dim
        mup_attn_scale_power mid_level_dataset_surplus dino_freeze_last_layer
        inference_dynamic_batching_paused_buffer_size_gb
        inference_dynamic_batching_prefix_caching_mamba_gb inprocess_last_call_wait
        inprocess_termination_grace_time
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


def check_domains(args, actions: dict) -> dict[str, str]:
    """Every flag whose value is outside its domain: dest -> its refusal line. The domains are this
    table's and those a typed options class put on its actions (config/typed.py)."""
    domains = {dest: (fam.domain, fam.name) for dest, fam in DOMAINS.items()}
    domains.update({dest: (a.domain, a.meaning) for dest, a in actions.items() if getattr(a, "domain", None)})
    refused = {}
    for dest, (domain, meaning) in domains.items():
        value = getattr(args, dest, None)
        if value is None or isinstance(value, str):
            continue
        if domain.refuses(value):
            refused[dest] = f"{flag_of(actions, dest)}={show(value)}: must be {domain}" + (f" ({meaning})" if meaning else "")
    return refused
