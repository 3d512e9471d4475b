"""The ledger's table of the run's flags (config/ledger.py): profiling and the training loop, RNG and
learning rate, checkpointing, distribution, validation and data, the tokenizer, logging, and what
belongs to Megatron-LM's other programs (reinforcement learning, inference, other models, its fault
tolerance); each honoured where it is read, refused and why, or without effect and why."""
from __future__ import annotations

from megatron_ext.config.ledger_vocabulary import (
    BLEND, DATA_LOADER, DDP, DDP_FROM_ARGS, EVALUATE, EVALUATE_LOOP, INFERENCE, ONE_LOGGER, OTHER_MODELS,
    PRETRAIN_GPT_IGNORES, RL, RULES, SCHEDULER, TOKENIZER, WANDB, Classification, only_with,
)

RUN = Classification()
honoured, refused, no_effect = RUN.honoured, RUN.refused, RUN.no_effect


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
