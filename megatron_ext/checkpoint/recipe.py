"""What a checkpoint records of the model it holds: ``iter_N/recipe.yaml``, the flags the run's recipe
and command line set (resolved), and ``iter_N/tokenizer/``, a copy of the files its tokenizer reads.

    iter_0000020/recipe.yaml     every flag the recipe or the command line set, resolved, except those
                                 that describe the run rather than the model (layout, data, schedule,
                                 optimizer, checkpointing, logging: RUN_GROUPS and RUN_FLAGS); those
                                 follow as comments, so the file says how the run was launched too
    iter_0000020/tokenizer/      the tokenizer's files (a Hugging Face directory without its weights)

The recipe loads on its own (``--recipe iter_N/recipe.yaml``; its tokenizer paths name the copy), and
a run that loads the checkpoint without ``--recipe`` reads it (:func:`recorded`, from
``arguments.parse`` through config/command_line.py ``recipe_values``; a conversion reads it once before
its run, checkpointing.first_read, and hands it to the parse): ``scripts/convert.py export`` and ``logits``, ``train.py --finetune --load RUN``.
``--recipe`` still overrides it. A run directory that was moved keeps working: a tokenizer path that
no longer exists is taken from the copy beside the recipe (:func:`relocate`)."""
from __future__ import annotations

import argparse
import enum
import os
import shutil

from megatron_ext.checkpoint import dirs as ckpt_dirs

RECIPE = "recipe.yaml"
TOKENIZER = "tokenizer"
# files of a Hugging Face model directory that are its weights, not its tokenizer
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".safetensors.index.json")

# Parser groups whose every flag describes the run, not the model: not recorded. A flag in no list is
# recorded: a run flag recorded is at worst refused by name where the checkpoint is loaded, a model flag
# left out would load the weights into another model. A capability whose flags describe the run adds
# its group here.
RUN_GROUPS = {
    "profiling", "rl", "RNG and initialization", "learning rate and weight decay", "checkpointing",
    "mixed precision", "distributed init", "validation", "autoresume", "biencoder", "vision", "logging",
    "Logits Distillation", "straggler", "workload inspector", "inference", "one logger", "In-process restart",
    "ft_package", "rerun engine", "msc", "fault injector", "regularization", "Transformer-Engine", "megatron_ext",
    "megatron_ext: planner", "megatron_ext: activation offload",
    "megatron_ext: backward-forward TP-communication overlap", "megatron_ext: MoE token dispatch",
}
# Flags of the other groups that describe the run: the layout, batches and lengths of training, data,
# recomputation, communication overlap, offload, CUDA graphs, how weights are initialised.
RUN_FLAGS = {
    # layout
    "tensor_model_parallel_size", "tensor_parallel_num_weight_shards", "pipeline_model_parallel_comm_backend",
    "pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size", "hierarchical_context_parallel_sizes",
    "max_seqlen_per_dp_cp_rank", "hybrid_context_parallel", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "expert_tensor_parallel_num_weight_shards",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "microbatch_group_size_per_vp_stage",
    # communication overlap and kernels chosen for speed
    "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_split_rs", "tp_comm_bootstrap_backend",
    "tp_comm_overlap_cfg", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
    "overlap_dispatch_backward_with_experts_wgrad", "ep_overlap_early_attn_memory_release", "use_ring_exchange_p2p",
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "overlap_p2p_comm_warmup_flush",
    "high_priority_a2a_comm_stream", "moe_grouped_gemm", "gradient_accumulation_fusion", "deterministic_mode",
    "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion", "cross_entropy_loss_fusion",
    "cross_entropy_fusion_impl", "use_flash_attn", "attention_backend",
    # recomputation, offload, CUDA graphs
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules", "recompute_activations", "checkpoint_activations", "moe_layer_recompute",
    "cpu_offloading_num_layers", "cpu_offloading_retain_pinned_cpu_buffers", "fine_grained_activation_offloading",
    "offload_modules", "min_offloaded_tensor_size", "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction",
    "fine_grained_offloading_max_inflight_offloads", "enable_cuda_graph", "cuda_graph_warmup_steps",
    "external_cuda_graph", "cuda_graph_impl", "inference_cuda_graph_scope",
    "moe_paged_stash", "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu",
    # the optimizer's and Megatron-FSDP's precision and buffers
    "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
    "megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype",
    "megatron_fsdp_enable_fine_grained_param_gather", "megatron_fsdp_max_pool_double_buffer",
    "fsdp_db_use_persist_buf_on_alloc_fail",
    # initialisation (a checkpoint's weights are loaded, not drawn)
    "perform_initialization", "use_cpu_initialization", "init_model_with_meta_device", "layout_invariant_init",
    # batches, lengths, exits, optimizer of the training loop
    "micro_batch_size", "global_batch_size", "rampup_batch_size", "step_batch_size_schedule",
    "decrease_batch_size_if_needed", "empty_unused_memory_level", "check_weight_hash_across_dp_replicas_interval",
    "gpu_sniff_test_interval", "train_sync_interval", "train_iters", "train_samples", "exit_interval",
    "exit_duration_in_mins", "exit_signal_handler", "exit_signal", "exit_signal_handler_for_dataloader",
    "exit_signal_handler_for_training", "manual_gc", "manual_gc_interval", "manual_gc_eval", "iterations_to_skip",
    "batch_size", "check_for_nan_in_loss_and_grad", "check_for_large_grads", "result_rejected_tracker_filename",
    "optimizer", "optimizer_cpu_offload", "optimizer_cuda_graph", "optimizer_offload_fraction",
    "use_torch_optimizer_for_cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "dump_param_to_param_group_map",
    "pin_cpu_grads", "pin_cpu_params", "dataloader_type", "deprecated_use_mcore_models", "calculate_per_token_loss",
    # data (the sequence length stays: a recipe needs one, and it bounds the model's positions)
    "data_path", "phase_transition_iterations", "split", "train_data_path", "valid_data_path", "test_data_path",
    "data_args_path", "per_split_data_args_path", "per_dataset_sequences_path", "dataloader_fast_cache_load",
    "dataloader_defer_npy_index_mmap", "data_cache_path", "mmap_bin_files", "mock_data", "sample_rate", "mask_prob",
    "short_seq_prob", "num_workers", "reset_position_ids", "reset_attention_mask", "dataloader_inter_document_masking",
    "eod_mask_loss", "create_attention_mask_in_dataloader", "num_dataset_builder_threads", "object_storage_cache_path",
    "mid_level_dataset_surplus", "allow_ambiguous_pad_tokens", "fim_data", "fim_rate", "fim_spm_rate",
    "fim_split_sample", "fim_fragment_rate", "fim_no_prefix", "fim_prefix_token", "fim_middle_token",
    "fim_suffix_token", "fim_pad_token", "fim_eod_token", "sft",
    # this project's run flags outside the groups above
    "save_keep_last", "no_ckpt_fallback",
}
_EXPLICIT = ("cli", "recipe")
_CHANGED = (", cli)", ", recipe)")


def megatron_groups(parser) -> dict:
    """dest -> the title of the group that declared it (--help lists the common flags apart:
    config/command_line.py order_help records where each came from)."""
    return {a.dest: getattr(a, "megatron_group", g.title) for g in parser._action_groups for a in g._group_actions}


def _recorded_dests(args, parser) -> tuple[dict, dict]:
    """(model flags, run flags): every flag the recipe or the command line set, by dest -> action."""
    groups = megatron_groups(parser)
    model, run = {}, {}
    sources = getattr(args, "config_sources", {})
    for action in parser._actions:
        dest = action.dest
        if not action.option_strings or dest in model or dest in run or not hasattr(args, dest):
            continue
        source = sources.get(dest, "default")
        # a value megatron changed from what the recipe or command line gave reads "megatron (was .., cli)"
        if not (source in _EXPLICIT or (source.startswith("megatron (was") and source.endswith(_CHANGED))):
            continue
        (run if dest in RUN_FLAGS or groups.get(dest) in RUN_GROUPS else model)[dest] = action
    return model, run


_UNWRITABLE = object()


def recipe_value(action, value):
    """A resolved value as a recipe writes it, so that the parser's action reads it back to the same
    value; _UNWRITABLE if no recipe value does."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            items = [recipe_value(argparse.Action([], "x"), v) for v in value]
            return _UNWRITABLE if any(i is _UNWRITABLE for i in items) else items
        # a type function parsed a string into a sequence (--moe-layer-freq, --window-size): the
        # string it reads back
        for text in ("[" + ",".join(map(str, value)) + "]", ",".join(map(str, value))):
            try:
                if action.type is not None and action.type(text) == value:
                    return text
            except (TypeError, ValueError, SyntaxError, argparse.ArgumentTypeError):
                continue
    return _UNWRITABLE


def describe(args, parser) -> dict:
    """What a save records of this run (arguments.parse keeps it as ``args.recorded_recipe``, where the
    parser is at hand): the recipe (model flags -> recipe values), the run's own flags, the dests no
    recipe value can express, and which recipe keys are the tokenizer's."""
    model, run = _recorded_dests(args, parser)
    recipe, run_values, unwritable = {}, {}, []
    for out, dests in ((recipe, model), (run_values, run)):
        for dest, action in dests.items():
            value = recipe_value(action, getattr(args, dest))
            if value is _UNWRITABLE:
                unwritable.append(dest)
            else:
                out[dest] = value
    tokenizer = {dest for dest, title in megatron_groups(parser).items() if title == "tokenizer"}
    return {"recipe": recipe, "run": run_values, "unwritable": sorted(unwritable),
            "tokenizer": sorted(tokenizer & set(recipe))}


def record(args, directory: str, final: str) -> bytes | None:
    """Write `directory`/recipe.yaml and copy the tokenizer's files into `directory`/tokenizer (one
    rank, before the checkpoint is committed); their paths in the recipe name `final`, where
    `directory` is renamed to at commit. Returns the recipe's bytes; None when the run was not parsed
    by arguments.parse (its recipe is unknown: nothing is written)."""
    import yaml

    described = getattr(args, "recorded_recipe", None)
    if described is None:
        return None
    recipe = dict(described["recipe"])
    tokenizer_dir = os.path.join(directory, TOKENIZER)
    for dest in described["tokenizer"]:
        path = recipe[dest]
        if not isinstance(path, str) or not os.path.exists(path):
            continue  # a hub name, or a value that is not a file
        os.makedirs(tokenizer_dir, exist_ok=True)
        if os.path.isdir(path):
            shutil.copytree(path, tokenizer_dir, dirs_exist_ok=True,
                            ignore=lambda d, names: [n for n in names if n.endswith(WEIGHT_FILES)])
            recipe[dest] = os.path.join(os.path.abspath(final), TOKENIZER)
        else:
            shutil.copy2(path, os.path.join(tokenizer_dir, os.path.basename(path)))
            recipe[dest] = os.path.join(os.path.abspath(final), TOKENIZER, os.path.basename(path))
    text = ["# The model this checkpoint holds: every flag the run's recipe and command line set, resolved,",
            "# except those that describe the run (layout, data, schedule, checkpointing; listed below as",
            "# comments). Read when the checkpoint is loaded without --recipe (scripts/convert.py export and",
            "# logits, train.py --load); --recipe overrides it. The tokenizer's files are copied beside it."]
    body = yaml.safe_dump(recipe, sort_keys=True) if recipe else ""
    tail = ["", "# the run's own flags (not applied when the checkpoint is loaded):"]
    if described["run"]:
        tail += ["# " + line for line in yaml.safe_dump(described["run"], sort_keys=True).splitlines()]
    if described["unwritable"]:
        tail.append(f"# not recorded (no recipe value expresses them): {', '.join(described['unwritable'])}")
    content = "\n".join(text) + "\n" + body + "\n".join(tail) + "\n"
    ckpt_dirs.write_atomic(os.path.join(directory, RECIPE), content)
    return content.encode()


def recorded(load: str | None, step: int | None = None, iterations: list[int] | None = None) -> str | None:
    """The recipe a run that loads `load` reads when no --recipe is given: the one recorded in the
    checkpoint it loads (`step`, or the newest committed one that has a recipe), else the one beside
    the checkpoints (an import's, or a directory written before checkpoints recorded theirs); None.
    ``iterations``: the committed ones, where the caller listed `load` already."""
    if not load or not os.path.isdir(load):
        return None
    if iterations is None:
        iterations = ckpt_dirs.committed_iterations(load)
    for iteration in ([step] if step is not None and step in iterations else iterations[::-1]):
        path = os.path.join(ckpt_dirs.checkpoint_dir(load, iteration), RECIPE)
        if os.path.isfile(path):
            return path
    path = os.path.join(load, RECIPE)
    return path if os.path.isfile(path) else None


def relocate(recipe: dict, path: str) -> dict:
    """A recorded recipe whose checkpoint directory moved: a tokenizer path that no longer exists is
    the copy beside the recipe (its part from `tokenizer` on)."""
    here = os.path.dirname(os.path.abspath(path))
    out = dict(recipe)
    for dest, value in recipe.items():
        if not isinstance(value, str) or os.path.exists(value):
            continue
        cut = value.rfind(os.sep + TOKENIZER)
        if cut >= 0:
            moved = here + value[cut:]
            if os.path.exists(moved):
                out[dest] = moved
    return out
