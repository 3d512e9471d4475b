"""The ledger's table of the model's flags (config/ledger.py): megatron's transformer configuration
(architecture, layers, precision, MoE, the parallel layout, recompute, FP8, CUDA graphs), the network
size and the optimizer; each honoured where it is read, refused and why, or without effect and why."""
from __future__ import annotations

from megatron_ext.config.ledger_vocabulary import (
    CONFIG_FROM_ARGS, HYBRID, INFERENCE, MLA, OPT, OTHER_MODELS, PRETRAIN_GPT_IGNORES, TC, VALIDATE, VOCAB_PADDING,
    YARN_FROM_ARGS, Classification, only_with,
)

MODEL = Classification()
honoured, refused, no_effect = MODEL.honoured, MODEL.refused, MODEL.no_effect


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
