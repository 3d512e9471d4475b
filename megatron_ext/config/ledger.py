"""LEDGER: every flag of megatron's parser (megatron.training.arguments.add_megatron_arguments) and
what it does in this loop, one of

    Honoured(where)      the code that reads it: a function of megatron_ext, or megatron's own code
                         this loop calls (READERS names who calls it); a megatron config class means
                         every field of that name is copied from the flag by megatron's from-args
                         builder, and megatron-core's modules read the config
    Refused(where, why)  refused by name before any compute. NOT_HERE: by the ledger's own rule
                         (config/rules.py check_not_here) whenever the flag is set to anything but its
                         default, with `why`; RULES: by a rule of config/rules.py naming it; else
                         the function of megatron_ext that raises the refusal
    NoEffect(why)        accepted and without effect here, by design, and why (mostly: megatron's
                         pretrain_gpt.py does not read it either)

tests/config/test_ledger.py fails when megatron's parser has a flag the ledger does not classify,
when an honoured flag is not read where the ledger says, or when a refused one is not refused.
docs/flags.md lists the ledger (scripts/flags_doc.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Honoured:
    where: str


@dataclass(frozen=True)
class Refused:
    where: str
    why: str = ""


@dataclass(frozen=True)
class NoEffect:
    why: str


NOT_HERE = "megatron_ext.config.rules:check_not_here"
RULES = "megatron_ext.config.rules:RULES"

# megatron's code that reads flags, and the function of this loop that calls it (or builds it)
TC = "megatron.core.transformer.transformer_config:TransformerConfig"
MLA = "megatron.core.transformer.transformer_config:MLATransformerConfig"
DDP = "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig"
OPT = "megatron.core.optimizer.optimizer_config:OptimizerConfig"
CONFIG_FROM_ARGS = "megatron.training.argument_utils:core_transformer_config_from_args"
YARN_FROM_ARGS = "megatron.training.argument_utils:_apply_yarn_config_from_args"
DDP_FROM_ARGS = "megatron.training.training:get_megatron_ddp_config"
VALIDATE = "megatron.training.arguments:validate_args"
SCHEDULER = "megatron.training.training:get_optimizer_param_scheduler"
TOKENIZER = "megatron.core.tokenizers.utils.build_tokenizer:build_tokenizer"
VOCAB_PADDING = "megatron.core.tokenizers.utils.build_tokenizer:vocab_size_with_padding"
BLEND = "megatron.training.utils.common_utils:get_blend_and_blend_per_split"
DATA_LOADER = "megatron.training.datasets.data_samplers:build_pretraining_data_loader"
EVALUATE = "megatron.training.training:evaluate_and_print_results"
EVALUATE_LOOP = "megatron.training.training:evaluate"
WANDB = "megatron.training.global_vars:_set_wandb_writer"

READERS = {  # megatron's reader -> (the function of megatron_ext that calls it, the name it calls)
    TC: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    MLA: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    CONFIG_FROM_ARGS: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    YARN_FROM_ARGS: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    DDP: ("megatron_ext.training.model:_wrap_chunks", "get_megatron_ddp_config"),
    DDP_FROM_ARGS: ("megatron_ext.training.model:_wrap_chunks", "get_megatron_ddp_config"),
    OPT: ("megatron_ext.training.optimizer:build_optimizer", "get_megatron_optimizer_config"),
    VALIDATE: ("megatron_ext.config.command_line:finalize", "validate_args"),
    SCHEDULER: ("megatron_ext.training.optimizer:build_scheduler", "get_optimizer_param_scheduler"),
    TOKENIZER: ("megatron_ext.training.tokenizer:build", "build_tokenizer"),
    VOCAB_PADDING: ("megatron_ext.training.tokenizer:padded_vocab_size", "vocab_size_with_padding"),
    BLEND: ("megatron_ext.training.data:dataset_config", "get_blend_and_blend_per_split"),
    DATA_LOADER: ("megatron_ext.training.data:_iterators", "build_pretraining_data_loader"),
    EVALUATE: ("megatron_ext.training.evaluation:run", "evaluate_and_print_results"),
    EVALUATE_LOOP: (EVALUATE, "evaluate"),  # megatron's evaluate_and_print_results calls it
    WANDB: ("megatron_ext.training.log_line:TrainingLogger._wandb", "_set_wandb_writer"),
}

LEDGER: dict = {}
# Flags megatron adds only where an optional package is installed (NVIDIA kitchen).
OPTIONAL = {"kitchen_config_file", "kitchen_recipe_number"}


def _add(entry, flags: str) -> None:
    for dest in flags.split():
        assert dest not in LEDGER, f"{dest} classified twice"
        LEDGER[dest] = entry


def honoured(where: str, flags: str) -> None:
    _add(Honoured(where), flags)


def refused(why: str, flags: str, where: str = NOT_HERE) -> None:
    _add(Refused(where, why), flags)


def no_effect(why: str, flags: str) -> None:
    _add(NoEffect(why), flags)


# --- shared reasons ---------------------------------------------------------------------------
PRETRAIN_GPT_IGNORES = "megatron 0.19.2 reads it nowhere (Megatron-LM's pretrain_gpt.py ignores it too)"
OTHER_MODELS = "for Megatron-LM's other models (BERT, T5, vision, retrieval); pretrain_gpt.py does not read it"
INFERENCE = "megatron's inference engine and text-generation server; training does not read it"
RL = "megatron's reinforcement learning (--perform-rl-step, refused here)"
HYBRID = "hybrid (Mamba) models only: --hybrid-layer-pattern / --is-hybrid-model are refused here"
ONE_LOGGER = "NVIDIA's one-logger telemetry, which this loop does not send (the flag only turns it off or names it)"


def only_with(flag: str) -> str:
    return f"read only with {flag}, which is refused here"


# --- transformer configuration (megatron's TransformerConfig fields, copied by core_transformer_config_from_args)
honoured(TC, """
    tensor_model_parallel_size pipeline_model_parallel_size sequence_parallel context_parallel_size
    expert_model_parallel_size expert_tensor_parallel_size perform_initialization use_cpu_initialization
    deterministic_mode cross_entropy_loss_fusion cross_entropy_fusion_impl
    overlap_moe_expert_parallel_comm delay_wgrad_compute overlap_dispatch_backward_with_experts_wgrad
    ep_overlap_early_attn_memory_release use_ring_exchange_p2p defer_embedding_wgrad_compute
    wgrad_deferral_limit overlap_p2p_comm_warmup_flush microbatch_group_size_per_vp_stage mtp_standalone
    cpu_offloading_num_layers cpu_offloading_retain_pinned_cpu_buffers num_layers mtp_num_layers
    mtp_loss_scaling_factor mtp_use_repeated_layer mtp_detach_heads account_for_embedding_in_pipeline_split
    account_for_loss_in_pipeline_split hidden_size num_attention_heads
    flash_attention_version softmax_type num_query_groups ffn_hidden_size kv_channels hidden_dropout
    attention_dropout fp32_residual_connection layernorm_epsilon layernorm_zero_centered_gamma add_bias_linear
    add_qkv_bias glu_linear_offset activation_func_clamp_value normalization qk_layernorm qk_l2_norm
    attention_output_gate calculate_per_token_loss multi_latent_attention init_method_std
    embedding_init_method_std mup_width_mult mup_base_hidden_size mup_embedding_mult mup_output_mult
    mup_base_head_dim mup_attn_scale_power apply_query_key_layer_scaling
    disable_bf16_reduced_precision_matmul use_fused_weighted_squared_relu fused_residual_rmsnorm
    recompute_granularity recompute_method recompute_num_layers distribute_saved_activations
    recompute_modules fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len
    fp8_amax_compute_algo fp8_output_proj fp4 fp4_recipe fp4_quantizer_factory high_priority_a2a_comm_stream
    moe_shared_expert_intermediate_size moe_shared_expert_gate moe_shared_expert_overlap
    use_grouped_gemm_for_shared_expert moe_shared_expert_glu_interleave_size moe_ffn_hidden_size
    moe_router_topk moe_enable_routing_replay moe_router_padding_for_quantization moe_router_padding_for_fp8
    moe_router_num_groups moe_router_group_topk moe_router_pre_softmax moe_router_topk_scaling_factor
    moe_router_score_function moe_router_dtype moe_router_enable_expert_bias moe_router_bias_update_rate
    moe_router_quantile_balancing_ema moe_router_force_load_balancing moe_router_force_biased
    moe_grouped_gemm moe_single_grouped_weight moe_single_grouped_bias moe_z_loss_coeff moe_input_jitter_eps
    moe_token_dispatcher_type moe_enable_deepep moe_flex_dispatcher_backend moe_permute_fusion_into_hybridep
    moe_hybridep_pad_uneven_dispatch_inputs moe_expert_capacity_factor moe_pad_expert_input_to_capacity
    moe_pad_experts_for_cuda_graph_inference moe_token_drop_policy moe_layer_recompute moe_permute_fusion
    moe_router_fusion moe_apply_probs_on_input moe_latent_size moe_flex_dispatcher_num_sms moe_deepep_num_sms
    moe_hybridep_num_sms moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
    moe_hybridep_num_sms_preprocessing moe_ncclep_static_shape moe_ncclep_zero_copy moe_mlp_glu_interleave_size
    clone_scatter_output_in_embedding config_logger_dir flash_decode
    symmetric_ar_type nccl_all_reduce_for_prefill inference_fuse_tp_communication
    inference_disable_triton_nvls_kernels inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
    inference_moe_token_dispatcher_type mrope_section mlp_chunks_for_prefill mlp_chunks_for_training
    transformer_impl fine_grained_activation_offloading offload_modules min_offloaded_tensor_size
    delay_offload_until_cuda_graph delta_offload_bytes_across_pp_ranks activation_offload_fraction
    fine_grained_offloading_max_inflight_offloads
    window_size window_attn_skip_freq no_rope_freq masked_softmax_fusion
    bias_dropout_fusion apply_rope_fusion gradient_accumulation_fusion attention_softmax_in_fp32
    pipeline_model_parallel_layout overlap_p2p_comm cp_comm_type test_mode moe_layer_freq
    moe_router_load_balancing_type moe_aux_loss_coeff barrier_with_L1_time
""")
# FP8: transformer-engine's recipes read the config's fields (--transformer-impl transformer_engine); the
# local spec's FP8 is torchao's float8 products (megatron_ext/fp8), which reads them from the arguments
honoured("megatron_ext.fp8:enabled", "fp8")
honoured("megatron_ext.config.rules:_local_fp8_recipe", "fp8_recipe")
honoured("megatron_ext.fp8:recipe", "fp8_wgrad")
honoured("megatron_ext.fp8:_high_precision_layer",
         "first_last_layers_bf16 num_layers_at_start_in_bf16 num_layers_at_end_in_bf16")
honoured(MLA, "q_lora_rank kv_lora_rank qk_head_dim qk_pos_emb_head_dim v_head_dim rotary_scaling_factor mscale "
         "mscale_all_dim cache_mla_latents")
honoured(CONFIG_FROM_ARGS, """
    group_query_attention squared_relu swiglu quick_geglu bias_gelu_fusion bias_swiglu_fusion
    no_persist_layer_norm rotary_interleaved rope_type init_method_xavier_uniform decoder_first_pipeline_num_layers
    decoder_last_pipeline_num_layers num_experts fp4_param_gather fp8_param_gather te_precision_config_file
""")
honoured(YARN_FROM_ARGS, "yarn_original_max_position_embeddings yarn_beta_fast yarn_beta_slow "
         "yarn_correction_range_round_to_int")
refused("megatron passes the remat sizes to initialize_model_parallel (generalized TP, transformer-engine >= "
        "2.19); this loop's process groups are built without them",
        "tensor_parallel_num_weight_shards expert_tensor_parallel_num_weight_shards")
refused("a process-group option of megatron's initialize_model_parallel that this loop's process groups "
        "(megatron_ext/training/parallel.py) are built without",
        """pipeline_model_parallel_comm_backend hierarchical_context_parallel_sizes use_tp_pp_dp_mapping
           use_sharp sharp_enabled_group high_priority_stream_groups nccl_communicator_config_path
           use_gloo_process_groups num_distributed_optimizer_instances""")
refused("hybrid context parallelism runs megatron's own sampler and schedule (data_samplers.py, "
        "training.py dummy_train_step), not this loop's", "hybrid_context_parallel")
no_effect(only_with("--hybrid-context-parallel"), "max_seqlen_per_dp_cp_rank")
refused("transformer-engine's userbuffers are set up by megatron's initialize_megatron "
        "(_initialize_tp_communicators), which this loop does not run; --overlap-tp-comm-1f1b hides TP "
        "communication here", "tp_comm_overlap")
no_effect(only_with("--tp-comm-overlap"), """
    tp_comm_bulk_wgrad tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
    tp_comm_split_ag tp_comm_split_rs tp_comm_bootstrap_backend tp_comm_overlap_cfg
""")
no_effect("megatron-core 0.19.2 reads it nowhere but its checkpoint-arguments loader (pretrain_gpt.py "
          "ignores it too)", "mtp_hybrid_override_pattern")
no_effect(PRETRAIN_GPT_IGNORES + ": megatron-core's layers add the residual before the norm",
          "apply_residual_connection_post_layernorm")
refused("megatron applies it after each optimizer step in its own train_step (training.py clip_qk), "
        "which this loop does not run", "qk_clip log_max_attention_logit")
no_effect(only_with("--qk-clip"), "qk_clip_alpha qk_clip_threshold")
refused("the experimental attention variants (gated delta net, DSA) get their layer specs from megatron's "
        "GPT builder (experimental_attention_variant_module_specs), not from this loop's specs",
        "experimental_attention_variant")
no_effect(only_with("--experimental-attention-variant"), """
    dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_skip_topk_offset
    dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss dsa_kernel_backend dsa_indexer_rope_interleaved
    dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
    linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads
    linear_attention_freq
""")
honoured("megatron_ext.training.model:build_chunks", "fp16 bf16")
honoured("megatron_ext.training.run:Run.build", "init_model_with_meta_device")
refused("megatron wraps its schedule for the per-rank token budget and the paged stash in its own training "
        "loop (training.py PagedStashRunner: an overflowing step is re-run); this loop's fixed-size dispatch "
        "is --moe-dropless-budget-factor", "moe_expert_rank_capacity_factor moe_paged_stash")
no_effect(only_with("--moe-paged-stash"), "moe_paged_stash_page_size moe_paged_stash_buffer_size_factor_cuda "
          "moe_paged_stash_buffer_size_factor_cpu")
refused("a layer-spec choice megatron's GPT builder (megatron/training/models/gpt.py) passes to "
        "transformer-engine's spec, which this loop's layer specs do not take",
        "use_transformer_engine_op_fuser use_kitchen_attention use_te_activation_func use_grouped_gemm_for_dense_mlp "
        "mla_down_proj_fusion")
# the local spec's core attention (torch SDPA or megatron's DotProductAttention, megatron_ext/attention/);
# transformer-engine's spec passes it on to transformer-engine (megatron's LanguageModule)
honoured("megatron_ext.attention:backend_name", "attention_backend")
no_effect(only_with("--use-kitchen-attention"), "kitchen_attention_backend")
refused("a kitchen quantization recipe is chosen by megatron's GPT builder, not by this loop's layer specs",
        "kitchen_config_file kitchen_recipe_number")
# --cuda-graph-impl local --cuda-graph-modules moe (or --cuda-graph-scope moe) with --moe-zero-sync-dropless:
# megatron's graph manager captures every MoE layer (megatron_ext/moe/graphs.py); every other value is
# refused there by name
honoured("megatron_ext.moe.graphs:before_validate", "cuda_graph_impl cuda_graph_modules cuda_graph_scope_deprecated")
honoured(TC, "cuda_graph_warmup_steps")  # the warmup passes of megatron's graph manager (cuda_graphs.py:1259)
refused("megatron captures these in its own training loop (training.py: TECudaGraphHelper, FullCudaGraphWrapper, "
        "OptimizerCudaGraphWrapper), which this loop does not run; this loop's CUDA graphs: --cuda-graph-impl local "
        "--cuda-graph-modules moe with --moe-zero-sync-dropless",
        "enable_cuda_graph external_cuda_graph optimizer_cuda_graph")
no_effect(INFERENCE, "inference_cuda_graph_scope")
refused("megatron's initialize_megatron switches the batch-invariant kernels on for the whole process; this "
        "loop does not", "batch_invariant_mode")
refused("this loop builds megatron-core's GPTModel; a hybrid (Mamba) model is megatron's HybridModel",
        "is_hybrid_model hybrid_layer_pattern hybrid_override_pattern")
no_effect(HYBRID, """
    mamba_state_dim mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path
    mamba_training_ssm_states_dtype mamba_inference_conv_states_dtype mamba_inference_ssm_states_dtype
""")

# --- network size, regularization ------------------------------------------------------------------
honoured(VALIDATE, """
    encoder_num_layers use_rotary_position_embeddings add_position_embedding no_weight_decay_cond_type
    batch_size recompute_activations checkpoint_activations warmup model_parallel_size
    num_layers_per_virtual_pipeline_stage num_virtual_stages_per_pipeline_rank encoder_seq_length
    grad_reduce_in_bf16 use_dist_ckpt_deprecated dist_ckpt_format_deprecated
    ckpt_fully_parallel_save_deprecated
""")
no_effect(OTHER_MODELS, """
    decoder_num_layers relative_attention_num_buckets relative_attention_max_distance bert_binary_head
    decoder_seq_length sample_rate mask_prob short_seq_prob output_bert_embeddings bert_embedder_type
    vocab_extra_ids
""")
honoured("megatron_ext.training.model:_gpt_model", """
    max_position_embeddings position_embedding_type use_rope_scaling rope_scaling_factor
    untie_embeddings_and_output_weights padded_vocab_size rotary_seq_len_interpolation_factor rotary_base rotary_percent
    fp16_lm_cross_entropy
""")
honoured(VOCAB_PADDING, "make_vocab_size_divisible_by")
no_effect(PRETRAIN_GPT_IGNORES, "openai_gelu onnx_safe use_flash_attn deprecated_use_mcore_models "
          "dist_ckpt_save_pre_mcore_014 enable_full_sharding_in_hsdp")
honoured(OPT, """
    weight_decay apply_wd_to_qk_layernorm clip_grad adam_beta1 adam_beta2 adam_eps sgd_momentum muon_momentum
    muon_split_qkv muon_nesterov muon_scale_mode muon_fp32_matmul_prec muon_coefficient_type muon_num_ns_steps
    muon_tp_mode muon_extra_scale_factor muon_scalar_optimizer lion_beta1 lion_beta2 optimizer
    optimizer_cpu_offload optimizer_offload_fraction use_torch_optimizer_for_cpu_offload
    overlap_cpu_optimizer_d2h_h2d pin_cpu_grads pin_cpu_params lr min_lr decoupled_lr decoupled_min_lr
    loss_scale initial_loss_scale min_loss_scale loss_scale_window hysteresis reuse_grad_buf_for_mxfp8_param_ag
    overlap_param_gather overlap_param_gather_with_optimizer_step use_distributed_optimizer
    use_precision_aware_optimizer main_grads_dtype main_params_dtype exp_avg_dtype exp_avg_sq_dtype
    log_num_zeros_in_grad
""")

# --- profiling, training ----------------------------------------------------------------------------
honoured("megatron_ext.training.observability:StepRange.__init__", """
    profile profile_step_start profile_step_end profile_ranks record_memory_history
""")
honoured("megatron_ext.training.observability:StepRange._start_profiler", """
    use_pytorch_profiler pytorch_profiler_collect_shapes pytorch_profiler_collect_callstack
""")
honoured("megatron_ext.training.observability:StepRange.close", "memory_snapshot_path")
refused("a profiler option of megatron's own training loop (training.py: the Chakra trace, NVTX ranges "
        "around its step) that this loop's profiler range does not take",
        "pytorch_profiler_collect_chakra record_shapes nvtx_ranges")
honoured("megatron_ext.training.step:train_step", "micro_batch_size")
honoured("megatron_ext.training.optimizer:build_optimizer", "use_mup")
honoured("megatron_ext.training.step:_empty_unused_memory", "empty_unused_memory_level")
honoured("megatron_ext.training.data:num_samples", "global_batch_size train_iters train_samples eval_iters "
         "eval_interval start_eval_at_iter eval_global_batch_size skip_train")
honoured(SCHEDULER, """
    lr_decay_style lr_wsd_decay_style lr_decay_iters lr_decay_samples lr_wsd_decay_iters lr_wsd_decay_samples
    lr_warmup_fraction lr_warmup_iters lr_warmup_samples lr_warmup_init override_opt_param_scheduler
    use_checkpoint_opt_param_scheduler start_weight_decay end_weight_decay weight_decay_incr_style
""")
refused("", "rampup_batch_size step_batch_size_schedule",
        where="megatron_ext.training.optimizer:refuse_batch_size_schedules")
refused("a step of megatron's own training loop (training.py) that this loop does not run", """
    decrease_batch_size_if_needed check_weight_hash_across_dp_replicas_interval
    gpu_sniff_test_interval train_sync_interval iterations_to_skip dump_param_to_param_group_map
    save_params_interval save_activations_interval save_tokens_per_expert_interval save_wgrads_interval
    save_dgrads_interval distributed_timeout_seconds_after_init log_progress log_energy
    log_world_size_to_tensorboard log_device_memory_used adlr_autoresume
""")
no_effect(only_with("--adlr-autoresume"), "adlr_autoresume_interval")
honoured("megatron_ext.training.exits:ExitConditions.after_step", "exit_interval manual_gc_interval")
honoured("megatron_ext.training.exits:ExitConditions._duration_reached", "exit_duration_in_mins")
honoured("megatron_ext.training.exits:ExitConditions.__init__", "exit_signal_handler exit_signal manual_gc")
honoured("megatron_ext.training.evaluation:run", "manual_gc_eval")
no_effect(PRETRAIN_GPT_IGNORES + " (set in its training config only)", "exit_signal_handler_for_dataloader")
refused("megatron's set_global_variables installs this signal handler for the whole run; this loop's "
        "is --exit-signal-handler", "exit_signal_handler_for_training")
honoured("megatron_ext.training.observability:NonFiniteCheck.__init__", "check_for_nan_in_loss_and_grad")
honoured(DDP_FROM_ARGS, """
    check_for_large_grads accumulate_allreduce_grads_in_fp32 ddp_num_buckets ddp_bucket_size
    ddp_pad_buckets_for_high_nccl_busbw ddp_reduce_scatter_with_fp32_accumulation
    ddp_param_name_patterns_for_fp32_local_accumulation ddp_average_in_collective megatron_fsdp_main_params_dtype
    megatron_fsdp_main_grads_dtype megatron_fsdp_grad_comm_dtype torch_fsdp2_reshard_after_forward
""")
honoured(DDP, """
    overlap_grad_reduce align_param_gather nccl_ub disable_symmetric_registration fsdp_manual_registration
    data_parallel_sharding_strategy outer_dp_sharding_strategy gradient_reduce_div_fusion fsdp_double_buffer
    suggested_communication_unit_size keep_fp8_transpose_cache megatron_fsdp_enable_fine_grained_param_gather
    megatron_fsdp_max_pool_double_buffer fsdp_db_use_persist_buf_on_alloc_fail
""")
no_effect("megatron's rerun state machine file; this loop runs no rerun machine (--rerun-mode)",
          "result_rejected_tracker_filename")
honoured("megatron_ext.training.data:_iterators", "dataloader_type")

# --- reinforcement learning -------------------------------------------------------------------------
refused("megatron's reinforcement learning loop (GRPO rollouts, inference engine) is not this loop",
        "perform_rl_step")
no_effect(RL, """
    rl_prompts_per_eval grpo_prompts_per_step grpo_group_size rl_generation_lag rl_submission_granularity
    rl_consumption_granularity grpo_iterations grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_kl_beta
    grpo_entropy_term_weight grpo_filter_groups_with_same_reward langrl_env_config rl_default_temperature
    rl_default_top_p rl_default_top_k rl_offload_optimizer_during_inference rl_kv_cache_management_mode
    rl_persist_cuda_graphs rl_partial_rollouts rl_inference_logprobs_is_correction
    rl_importance_sampling_truncation_coef rl_use_sequence_packing rl_sequence_packing_max_sequences_per_bin
    rl_sequence_packing_algo rl_training_cuda_graphs rl_inference_tensor_model_parallel_size
    rl_inference_pipeline_model_parallel_size rl_inference_expert_model_parallel_size
    rl_inference_expert_tensor_model_parallel_size rl_inference_model_unified_memory_level
    rl_offload_inference_model_weights_when_idle refit_method rl_verify_model_weights_swap rl_skip_bos_token
    rl_profile rl_profile_dir rl_inference_parsers
""")

# --- RNG, learning rate -----------------------------------------------------------------------------
honoured("megatron_ext.training.run:Run.initialize", "seed enable_experimental")
refused("megatron's _set_random_seed option; this loop seeds every rank as megatron's default does "
        "(megatron_ext/training/parallel.py set_seed)", "te_rng_tracker inference_rng_tracker data_parallel_random_init")
honoured("megatron_ext.training.hooks:before_wrap", "freeze_all_layers")

# --- checkpointing ----------------------------------------------------------------------------------
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer.after_step", "save_interval")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer._apply_retention", "save save_retain_interval")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer.load", "load finetune ckpt_step exit_on_missing_checkpoint "
         "pretrained_checkpoint")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer._load", """
    ckpt_format auto_detect_ckpt_format ckpt_fully_parallel_load dist_ckpt_strictness no_load_rng
""")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer._optimizer_to_load", "no_load_optim")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer._save_strategy",
         "ckpt_fully_parallel_save ckpt_assume_constant_structure")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer.save", "async_save no_save_optim no_save_rng")
honoured("megatron_ext.checkpoint.checkpointer:Checkpointer._async_queue", "use_persistent_ckpt_worker")
honoured("megatron_ext.checkpoint.state:sharding_metadata",
         "dist_ckpt_optim_fully_reshardable distrib_optim_fully_reshardable_mem_efficient")
no_effect("deprecated in megatron (read by its parse_args only): MSC is off unless --enable-msc, which is "
          "refused here", "disable_msc_deprecated")
refused("megatron's checkpoint code (checkpoint/checkpointer.py) has this option; this loop's checkpoints "
        "(megatron_ext/checkpoint/checkpointer.py) do not", """
    load_main_params_from_ckpt non_persistent_save_interval non_persistent_ckpt_type
    use_checkpoint_args ckpt_convert_format ckpt_convert_save ckpt_convert_update_legacy_dist_opt_format
    async_ckpt_cpu_priority async_ckpt_io_priority async_ckpt_use_cpu_shm ckpt_fully_parallel_load_exchange_algo
    ckpt_fully_parallel_save_process_group ckpt_fully_parallel_load_process_group
    ckpt_load_validate_sharding_integrity strict_fsdp_dtensor_load replication stream_ckpt_dequant
    override_ckpt_iteration dist_ckpt_workers enable_msc
""")
no_effect(only_with("--non-persistent-ckpt-type / --non-persistent-save-interval"),
          "non_persistent_global_ckpt_dir non_persistent_local_ckpt_dir non_persistent_local_ckpt_algo")
no_effect(only_with("--use-checkpoint-args"), "use_mp_args_from_checkpoint_args use_tokenizer_model_from_checkpoint_args")
no_effect(only_with("--replication"), "replication_jump replication_factor")
no_effect("asynchronous saves here always go through megatron-core's AsyncCallsQueue (what --async-strategy "
          "mcore selects); the checkpoint written is the same", "async_strategy")
no_effect("every load here verifies each file's checksum first (megatron_ext/checkpoint/integrity.py)",
          "verify_integrity")

# --- distributed -------------------------------------------------------------------------------------
refused("the backend follows the device here: NCCL with CUDA, gloo without (megatron_ext/platform)",
        "distributed_backend", where=RULES)
honoured("megatron_ext.training.run:Run.initialize", "distributed_timeout_minutes logging_level")
honoured("megatron_ext.training.optimizer:configure_schedule_hooks", "align_grad_reduce")
no_effect("the device comes from the launcher's LOCAL_RANK (megatron_ext/platform current()), as megatron's "
          "own fallback does", "local_rank")
refused("an initialization option of megatron's initialize_megatron, which this loop does not run",
        "lazy_mpu_init disable_jit_fuser fake_process_group")
honoured("megatron_ext.training.model:wrap", "use_megatron_fsdp use_torch_fsdp2")
refused("megatron's get_model option for its distributed optimizer's layout, which this loop's wrapper "
        "does not take", "use_layer_wise_param_layout create_all_gather_group")
refused("megatron's NCCL flight recorder is set up by its _initialize_distributed, which this loop does not run",
        "flight_recorder_dump_path")
no_effect(only_with("--flight-recorder-dump-path"), """
    flight_recorder_trace_buffer_size flight_recorder_dump_on_timeout flight_recorder_include_stack_trace
    flight_recorder_include_only_active flight_recorder_extra_dump_on_exec
""")

# --- validation, data ----------------------------------------------------------------------------------
honoured(EVALUATE, "log_validation_ppl_to_tensorboard")
honoured(EVALUATE_LOOP, "eval_micro_batch_size")
refused("", "full_validation multiple_validation_sets fim_data", where="megatron_ext.training.data:validate")
honoured("megatron_ext.sft:datasets", "sft")
no_effect(only_with("--multiple-validation-sets"), "validation_set_names")
no_effect(only_with("--fim-data"), """
    fim_rate fim_spm_rate fim_split_sample fim_fragment_rate fim_no_prefix fim_prefix_token fim_middle_token
    fim_suffix_token fim_pad_token fim_eod_token
""")
honoured(BLEND, "data_path train_data_path valid_data_path test_data_path data_args_path per_split_data_args_path")
honoured("megatron_ext.training.data:dataset_config", """
    split data_cache_path mmap_bin_files reset_position_ids reset_attention_mask eod_mask_loss
    create_attention_mask_in_dataloader num_dataset_builder_threads mock_data seq_length
""")
refused("an option of megatron's GPT dataset that this loop's dataset configuration "
        "(megatron_ext/training/data.py dataset_config) does not pass", """
    phase_transition_iterations per_dataset_sequences_path dataloader_fast_cache_load
    dataloader_defer_npy_index_mmap dataloader_inter_document_masking object_storage_cache_path
    mid_level_dataset_surplus allow_ambiguous_pad_tokens
""")
honoured(DATA_LOADER, "num_workers data_sharding")

# --- tokenizer ----------------------------------------------------------------------------------------
honoured(TOKENIZER, """
    vocab_size vocab_file merge_file tokenizer_type tokenizer_model metadata_path special_tokens
    tiktoken_pattern tiktoken_num_special_tokens tokenizer_sentencepiece_legacy
    tokenizer_sentencepiece_ignore_extra_whitespaces tokenizer_hf_no_use_fast tokenizer_hf_no_include_special_tokens
    trust_remote_code null_tokenizer_eod_id null_tokenizer_pad_id chat_template sft_tokenizer_prompt_format
""")
honoured("megatron_ext.training.tokenizer:configure", "pad_vocab_size")

# --- models this loop does not train ---------------------------------------------------------------------
no_effect(OTHER_MODELS, """
    ict_head_size biencoder_projection_dim biencoder_shared_query_context_model ict_load bert_load
    titles_data_path query_in_block_prob use_one_sent_docs evidence_data_path retriever_report_topk_accuracies
    retriever_score_scaling block_data_path embedding_path indexer_batch_size indexer_log_interval num_classes
    img_h img_w num_channels patch_dim classes_fraction data_per_class_fraction head_lr_mult vision_pretraining
    vision_pretraining_type vision_backbone_type swin_backbone_type mask_type mask_factor iter_per_epoch
    dino_local_img_size dino_local_crops_number dino_head_hidden_size dino_bottleneck_size dino_freeze_last_layer
    dino_norm_last_layer dino_warmup_teacher_temp dino_teacher_temp dino_warmup_teacher_temp_epochs
""")

# --- MoE, heterogeneous layers ---------------------------------------------------------------------------
refused("megatron's upcycling turns a dense checkpoint into an MoE model in its get_model, which this loop "
        "does not run", "moe_use_upcycling")
no_effect(only_with("--moe-use-upcycling"), "moe_upcycling_granularity")
refused("a heterogeneous layer configuration needs megatron's heterogeneous layer specs "
        "(models/gpt/heterogeneous), which this loop's layer specs do not build",
        "heterogeneous_layers_config_path heterogeneous_layers_config_encoded_json")

# --- logging --------------------------------------------------------------------------------------------
honoured("megatron_ext.training.log_line:TrainingLogger.log", "log_interval log_params_norm")
honoured("megatron_ext.training.log_line:TrainingLogger.format", "log_throughput")
honoured("megatron_ext.seams.megatron_training:megatron_training_globals.__enter__", "timing_log_level timing_log_option")
honoured("megatron_ext.training.log_line:TrainingLogger._tensorboard", "tensorboard_dir tensorboard_queue_size")
honoured("megatron_ext.training.log_line:TrainingLogger._write_megatron_scalars",
         "log_timers_to_tensorboard log_memory_to_tensorboard")
honoured("megatron_ext.training.log_line:validate", "wandb_project wandb_exp_name wandb_save_dir")
honoured(WANDB, "wandb_entity")
honoured("megatron_ext.training.log_line:TrainingLogger._model_losses", "moe_per_layer_logging")
refused("TensorBoard scalars are written at each log line here (every --log-interval), not on their own "
        "interval", "tensorboard_log_interval")
no_effect("this loop writes no loss-scale scalar to TensorBoard (turning it off changes nothing)",
          "log_loss_scale_to_tensorboard")
no_effect("each log line already holds every rank's memory (peak RSS, or the CUDA allocator's peak)",
          "log_memory_interval")
refused("megatron's MoE routing trace is recorded by its own training loop", "moe_routing_trace_path")
no_effect(only_with("--moe-routing-trace-path"), """
    moe_routing_trace_max_training_iters moe_routing_trace_capture_logits moe_routing_trace_capture_hidden_states
    moe_routing_trace_dump_weights
""")
refused("logits for distillation are saved and loaded by megatron's own training loop",
        "logits_save_dir logits_load_dir")
no_effect(only_with("--logits-save-dir / --logits-load-dir"), """
    logits_save_top_k logits_save_top_p logits_save_top_p_min_k logits_save_dtype logits_load_decode_threads
    logits_load_prefetch_factor logits_load_msc_prefetch_depth logits_load_kd_loss_alpha logits_load_ignore_errors
""")
refused("megatron's straggler detector runs inside its own training loop", "log_straggler")
no_effect(only_with("--log-straggler"), "straggler_ctrlr_port straggler_minmax_count disable_straggler_on_startup")
refused("megatron's workload inspector server is started by its own training loop", "run_workload_inspector_server")

# --- inference --------------------------------------------------------------------------------------------
no_effect(INFERENCE, """
    inference_batch_times_seqlen_threshold max_tokens_to_oom use_legacy_static_engine inference_max_requests
    inference_max_seq_length inference_dynamic_batching inference_dynamic_batching_buffer_size_gb
    inference_dynamic_batching_paused_buffer_size_gb inference_dynamic_batching_mamba_memory_ratio
    inference_dynamic_batching_block_size inference_dynamic_batching_max_requests
    inference_dynamic_batching_max_tokens inference_dynamic_batching_num_cuda_graphs
    inference_dynamic_batching_track_paused_request_events inference_dynamic_batching_track_generated_token_events
    decode_only_cuda_graphs inference_cuda_graph_all_prefills inference_cuda_graph_max_tokens
    inference_dynamic_batching_unified_memory_level enable_chunked_prefill num_speculative_tokens
    inference_dynamic_batching_enable_prefix_caching inference_dynamic_batching_prefix_caching_eviction_policy
    inference_dynamic_batching_prefix_caching_coordinator_policy
    inference_dynamic_batching_prefix_caching_routing_alpha inference_dynamic_batching_prefix_caching_mamba_gb
    inference_dynamic_batching_cuda_graph_mixed_prefill_count
    inference_dynamic_batching_cuda_graph_sizing_distribution inference_dynamic_batching_sampling_backend
    offset_sampling_seed_by_dp_rank inference_dynamic_batching_async_sched_mode
    inference_dynamic_batching_logprobs_mode inference_logging_step_interval inference_text_gen_server_logging
    inference_wandb_logging inference_coordinator_port inference_use_synchronous_zmq_collectives
    inference_disable_ep_consensus inference_shards
""")

# --- experimental, telemetry, resilience ---------------------------------------------------------------
refused("", "spec yaml_cfg", where=RULES)
no_effect(ONE_LOGGER, "enable_one_logger one_logger_project one_logger_run_name one_logger_async app_tag_run_name "
          "app_tag_run_version")
refused("megatron's in-process restart wraps its own pretrain(); here a rank killed mid-step is restarted "
        "by torchrun --max-restarts or slurm and resumes from the newest checkpoint (docs/reliability.md)",
        "inprocess_restart")
no_effect(only_with("--inprocess-restart"), """
    inprocess_max_iterations inprocess_monitor_thread_interval inprocess_monitor_process_interval
    inprocess_progress_watchdog_interval inprocess_heartbeat_interval inprocess_soft_timeout inprocess_hard_timeout
    inprocess_heartbeat_timeout inprocess_barrier_timeout inprocess_completion_timeout inprocess_last_call_wait
    inprocess_termination_grace_time inprocess_granularity inprocess_active_world_size inprocess_empty_cuda_cache
""")
refused("the fault-tolerance package's heartbeats are sent by megatron's own training loop", "enable_ft_package")
no_effect(only_with("--enable-ft-package"), "calc_ft_timeouts ft_num_warmup_iters")
refused("megatron's rerun state machine (re-running an iteration to tell a transient fault from a "
        "persistent one) is driven by its own training loop; a non-finite loss stops the run here "
        "(--check-for-nan-in-loss-and-grad)", "rerun_mode", where=RULES)
refused("megatron's rerun state machine injects and checks these in its own training loop",
        "error_injection_rate check_for_spiky_loss")
no_effect(only_with("--error-injection-rate"), "error_injection_type")
refused("megatron's fault injector is started by its own training loop", "fault_injector_ranks fault_injector_num_ranks")
no_effect(only_with("--fault-injector-ranks / --fault-injector-num-ranks"), """
    fault_injector_fault_types fault_injector_fault_probabilities fault_injector_fault_delay
    fault_injector_delay_start_iteration fault_injector_mtti_seconds fault_injector_offset_seconds fault_injector_seed
""")


def not_here() -> dict:
    """dest -> why, for the flags refused whenever set (config/rules.py check_not_here)."""
    return {dest: e.why for dest, e in LEDGER.items() if isinstance(e, Refused) and e.where == NOT_HERE}
