"""Which tests `make test` runs, and in what order (tests/conftest.py applies both).

`make test` (CI) proves every property once, within the suite's budget (docs/tests.md). The tests in
MATRIX prove a property `make test` already proves, again on another architecture, layout or
composition; they carry the `matrix` mark and run with `make test-matrix`. Each entry says what
proves its property in `make test`, or what only it proves.

HEAVY_FIRST: the modules that cost the most CPU (measured with tests/cpu_per_test.py), handed to
pytest-xdist's workers first, and among them the few that mostly wait. A module is one unit of work
(`--dist loadfile`); given the heaviest last, one core idles while the other finishes it, and two
waiting modules side by side idle both."""
from __future__ import annotations

_ZOO = "tests/training/test_zoo.py::"
_OVERLAP = "tests/schedules/test_overlap.py::"
_HF_LAYOUTS = "tests/hf/test_layouts.py::test_finetune_on_one_process_and_tp1_with_ep"
_DAMAGED = "tests/training/test_checkpointing.py::test_damaged_checkpoint_is_named_and_the_older_one_resumes_exactly"
_LINKS = "tests/offload/test_offload.py::test_slow_and_fast_link_release_in_stream_order"
_TE = "tests/hf/test_te_names.py::test_local_to_transformer_engine_to_local_is_bitwise"
_FETCH = "tests/seams/test_fsdp_fetch.py::test_train_py_runs_bitwise_with_the_seams"

_TE_NAMES = ("only these convert a local checkpoint to transformer-engine's names and back; the dry run's key check: "
             "tests/hf/test_hf.py::test_dry_run_places_the_keys_in_the_whole_model")
_FSDP_MEMORY = ("only these check the bytes per rank against docs/fsdp.md's formula; every fetched byte released: "
                "tests/test_scripts.py::test_bench_fsdp_smoke")
_SAME_MLA_MOE = "the deepseek_v3 case: the same multi-latent attention and MoE layers"
_ZERO_SYNC = ("the deepseek_v3 case (the same zero-sync layer), and "
              "test_zero_sync_dropless_allgather_trains_bitwise_with_every_feature_on")
_HF_FAMILIES = ("the qwen3 and deepseek_v3 cases; every family's import, export and forward against "
                "transformers: tests/hf/test_hf.py")
_VPP_OVERLAP = ("the interleaved schedule overlapped: test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful] "
                "(MoE, PP x VPP, the stateful features) and tests/training/test_zoo.py's qwen3_235b case (TP2 + SP x "
                "PP2 x VPP2 x EP2 with every feature, bit for bit); the hand-offs counted: [dense-tp2_pp2]")
_WALKTHROUGH = ("the pages' commands as written; every step they take, in make test: a Hugging Face import and export "
                "(tests/hf/test_hf.py), SFT and LoRA fine-tunes of an import on a layout (tests/hf/test_layouts.py, "
                "tests/lora/), peft adapters in and out (tests/hf/test_peft_io.py), logits (tests/hf/test_hf.py), "
                "prepare_data.py's chat example (tests/test_prepare_data.py) and stdlib data (the Makefile's data step), "
                "and the other pages' commands (tests/test_docs.py)")

MATRIX: dict[str, str] = {
    # the model zoo: one architecture per kind of layer
    f"{_ZOO}test_architecture_trains_bitwise_with_every_feature_on[deepseek_v2_lite]": _SAME_MLA_MOE,
    f"{_ZOO}test_architecture_trains_bitwise_with_every_feature_on[kimi_k2]": _SAME_MLA_MOE,
    f"{_ZOO}test_architecture_trains_bitwise_with_every_feature_on[llama3]":
        "the qwen3 case: the same dense grouped-query layer, with query/key norms on",
    f"{_ZOO}test_architecture_trains_bitwise_with_every_feature_on[qwen3_moe]":
        "the deepseek_v3 and llama4 cases: MoE layers with the same dispatchers and features",
    f"{_ZOO}test_moe_architecture_trains_bitwise_zero_sync_dropless[deepseek_v2_lite]": _ZERO_SYNC,
    f"{_ZOO}test_moe_architecture_trains_bitwise_zero_sync_dropless[kimi_k2]": _ZERO_SYNC,
    f"{_ZOO}test_moe_architecture_trains_bitwise_zero_sync_dropless[qwen3_moe]": _ZERO_SYNC,
    f"{_ZOO}test_moe_architecture_trains_bitwise_zero_sync_dropless[llama4]": _ZERO_SYNC,
    f"{_ZOO}test_moe_recipes_under_pp_vpp_train_bitwise_with_every_feature_on[llama4_maverick]":
        "the qwen3_235b case: the same schedule, virtual stages and features",
    f"{_ZOO}test_features_with_recompute_and_mtp_train_bitwise[recompute_activations]":
        "selective and full recompute: tests/training/test_layouts.py (recompute-full, tp2-recompute-selective), "
        "tests/schedules/test_overlap.py::test_bitwise_equal_with_full_recompute",
    f"{_ZOO}test_features_with_recompute_and_mtp_train_bitwise[moe_layer_recompute]":
        "MoE-layer recompute under the overlap: tests/schedules/test_overlap.py "
        "test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful]",
    f"{_ZOO}test_moe_recipes_under_pp_vpp_train_bitwise_with_every_feature_on[deepseek_r1]":
        "the qwen3_235b case: a MoE recipe under the same schedule, virtual stages and features; only this case "
        "puts multi-latent attention, MTP and the shared-expert overlap under them",
    f"{_ZOO}test_features_with_recompute_and_mtp_train_bitwise[mtp_two_layers]":
        "only this trains multi-token prediction bitwise with the features on; MTP built and its loss logged: "
        "tests/training/test_megatron_flags.py::test_mtp_num_layers_builds_and_logs_the_mtp_loss",
    "tests/lora/test_zoo.py::test_lora_under_pp_vpp_trains_bitwise_with_every_feature_on[deepseek_r1]":
        "LoRA under virtual stages: tests/lora/test_layouts.py (pp2-vpp2, every factor's gradient against one "
        "process); MoE under PP x VPP with the stateful features: tests/schedules/test_overlap.py "
        "test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful]",
    # the 1F1B overlap: one case per schedule and per model kind
    f"{_OVERLAP}test_bitwise_equal_and_overlapped[moe-tp2_pp2]":
        "[dense-tp2_pp2] (the same 1F1B schedule) and test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful] "
        "(MoE in a pipeline)",
    f"{_OVERLAP}test_bitwise_equal_and_overlapped[dense-tp2_pp2_vpp2]": _VPP_OVERLAP,
    f"{_OVERLAP}test_bitwise_equal_and_overlapped[moe-tp2_pp2_vpp2]": _VPP_OVERLAP,
    f"{_OVERLAP}test_bitwise_equal_and_overlapped[moe-tp2]":
        "[dense-tp2] (the schedule without a pipeline) and test_moe_tp2_ep2_hands_off_expert_all_to_all (MoE at TP2)",
    "tests/hf/test_layouts.py::test_fine_tuned_under_context_parallelism_exports_for_transformers":
        "only this fine-tunes a Hugging Face import under CP and exports it; CP training against CP 1: "
        "tests/training/test_context_parallel.py; a fine-tuned run's export against transformers: "
        "test_finetune_on_one_process_and_tp1_with_ep",
    "tests/hf/test_layouts.py::test_fine_tuned_in_fp8_exports_for_transformers":
        "only this exports an FP8-trained run to Hugging Face; a fine-tuned run's export against transformers: "
        "test_finetune_on_one_process_and_tp1_with_ep; FP8 training: tests/fp8/test_training.py",
    **{f"tests/fp8/test_zoo.py::test_architecture_trains_in_fp8[{name}]":
       "FP8 training: tests/fp8/test_training.py (tiny_dense, tiny_moe); the in-place add to an FP8 output that "
       "gpt-oss's expert biases make: tests/fp8/test_linear.py::test_linear_numerics"
       for name in ("deepseek_v3", "deepseek_v2_lite", "kimi_k2", "qwen3", "qwen3_moe", "gpt_oss", "llama3", "llama4",
                    "nemotron")},
    **{f"tests/fp8/test_zoo.py::test_moe_architecture_trains_in_fp8_with_the_zero_sync_layer[{name}]":
       "the zero-sync layer in FP8: tests/fp8/test_training.py (tiny_moe with MLA and a shared expert), its grouped "
       "products bit for bit torchao's and free of host syncs: tests/fp8/test_linear.py"
       for name in ("deepseek_v3", "deepseek_v2_lite", "kimi_k2", "qwen3_moe", "gpt_oss", "llama4")},
    "tests/fp8/test_compose.py::test_fp8_on_every_layout_and_wrapper":
        "only this trains FP8 under the 1F1B overlap, PP, VPP, EP, Megatron-FSDP, FSDP2 and SFT; FP8's products and "
        "TP2 + SP: tests/fp8/test_linear.py; FP8 training: tests/fp8/test_training.py",
    "tests/training/test_context_parallel.py::test_features_compose_with_context_parallelism":
        "only this composes LoRA, Megatron-FSDP, FSDP2, the sync-free dispatcher and the zero-sync dropless layer with "
        "CP; CP training against CP 1: the deepseek_v2_lite case; each feature alone: its own tests",
    "tests/training/test_context_parallel.py::test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4":
        "only this resumes a checkpoint across CP sizes; exact resumes on other layouts: "
        "tests/training/test_checkpointing.py; CP training against CP 1: the deepseek_v2_lite case",
    "tests/training/test_context_parallel.py::test_losses_and_gradients_equal_cp1[gpt_oss]":
        "only this trains sliding windows and softmax sinks under CP (gpt-oss); their CP attention against one "
        "rank's: tests/attention/test_context_parallel.py; CP training: the deepseek_v2_lite case",
    # the fine-tuning walk-through's commands (offline.md makes the tiny model finetune.md uses), each step of it
    # proved in make test by its own tests
    "tests/test_docs.py::test_doc_commands_run[docs/offline.md]": _WALKTHROUGH,
    "tests/test_docs.py::test_doc_commands_run[docs/finetune.md]": _WALKTHROUGH,
    "tests/training/test_layouts.py::test_moe_layouts_match_single_process[tp2-pp2-vpp2]":
        "MoE against one process: [tp2-ep2-sp] and [pp2-ep2-distopt]; the interleaved schedule against one process: "
        "test_dense_layouts_match_single_process[tp2-pp2-vpp2]; MoE under TP2 x PP2 x VPP2: "
        "tests/schedules/test_overlap.py test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful]",
    "tests/training/test_context_parallel.py::test_losses_and_gradients_equal_cp1[qwen3]":
        "the deepseek_v2_lite case: training at CP 2 and 4 against CP 1, every comm type per layer; grouped-query "
        "attention under each comm type against one rank's: tests/attention/test_context_parallel.py (the gqa case)",
    f"{_OVERLAP}test_context_parallel_collectives_handed_off_bitwise[2]":
        "[1]: context-parallel attention's collectives handed over, bit for bit; TP's beside them: the tp2 cases",
    f"{_OVERLAP}test_warmup_forwards_pair_bitwise_without_dropout[dense]":
        "[moe-stateful]: the same paired warmup forwards on the same layout, with MoE and stateful modules",
    f"{_OVERLAP}test_warmup_forwards_pair_bitwise_without_dropout[moe]":
        "[moe-stateful]: the same MoE model, with the stateful modules on",
    f"{_OVERLAP}test_train_py_trains_a_recipe_with_it_on[recipes/tiny_moe.yaml-4-layout1]":
        "the tiny_dense case (train.py with the overlap on); MoE under the overlap: the pool cases of the module",
    f"{_OVERLAP}test_bitwise_equal_with_activation_offload[tp2_pp2]":
        "[tp2]; offload under pipelines: tests/offload/test_offload.py",
    f"{_OVERLAP}test_megatron_ep_overlap_with_offload_and_dispatchers_bitwise":
        "only this composes megatron's own --overlap-moe-expert-parallel-comm with offload and our dispatchers; "
        "our overlap with every dispatcher: test_ep_only_overlap_tp1_ep2_every_dispatcher",
    f"{_ZOO}test_per_pass_state_swap_is_needed":
        "a negative control (the overlap's per-pass swap of stateful modules turned off fails); the swap's "
        "effect: tests/schedules/test_overlap.py test_warmup_forwards_pair_bitwise_without_dropout[moe-stateful]",
    # stopping
    "tests/training/test_interrupt.py::test_ctrl_c_under_torchrun_stops_every_rank_saves_and_resumes_exactly":
        "the stop at a step boundary on every rank, the save, the one line and the exact resume, a rank signalled "
        "on the warm workers: test_sigterm_on_one_rank_stops_every_rank_at_the_same_step_saves_and_resumes_exactly; "
        "a Ctrl-C while starting: "
        "test_the_resume_command_loads_what_was_saved_and_a_ctrl_c_while_starting_is_one_line; "
        "only this sends Ctrl-C through torchrun's agent; a torchrun job killed and restarted: "
        "tests/training/test_restart.py",
    # the planner
    **{f"tests/planner/test_planner.py::test_predicted_peak_within_1_percent_context_parallel[{comm}]":
       "a CP rank's share of the sequence, its attention simulated in the trace (p2p, with offload): "
       "tests/test_scripts.py::test_bench_long_context_smoke" for comm in ("all_gather", "p2p")},
    "tests/planner/test_planner.py::test_predicted_peak_within_5_percent_many_experts_ep2":
        "test_predicted_peak_within_5_percent_zero_sync_dropless_ep2: a MoE EP2 peak within 5 %",
    "tests/planner/test_planner.py::test_choice_for_a_cluster_recipe_fits_when_scaled_down":
        "only this measures a searched choice (a cluster recipe's, scaled down to this machine); the planner's "
        "peaks against measured bytes: test_predicted_peak_within_5_percent_pp2_with_offload, "
        "test_predicted_peak_within_5_percent_zero_sync_dropless_ep2; its search and report: "
        "test_plan_json_components_and_candidates",
    "tests/planner/test_planner.py::test_published_qwen3_fits_as_given":
        "only this plans a published recipe as given; cluster-scale traces: tests/hf/test_layouts.py "
        "test_planner_traces_gpt_oss_at_tp1_and_llama4_on_transformer_engine",
    # the benchmarks' own launcher
    "tests/test_bench_launch.py::test_run_world_results_in_rank_order_and_clean_stdout":
        "only this starts the fresh worlds a full benchmark run launches; the benchmarks' smoke forms run the same "
        "functions on the suite's warm workers (tests/test_scripts.py)",
    # Hugging Face
    f"{_HF_LAYOUTS}[llama]": _HF_FAMILIES,
    "tests/hf/test_peft_io.py::test_imported_adapter_logits_equal_peft_packed_on_each_layout[qwen3]":
        "the deepseek_v3 case: an imported adapter's packed logits against peft's on each layout; qwen3's adapters "
        "in peft: test_trained_adapter_loads_in_peft_with_our_logits[qwen3]",
    f"{_HF_LAYOUTS}[gpt_oss]": _HF_FAMILIES + "; gpt-oss's layers trained with every feature: tests/training/"
                                             "test_zoo.py's gpt_oss case",
    f"{_HF_LAYOUTS}[qwen3_moe]": _HF_FAMILIES,
    f"{_HF_LAYOUTS}[mixtral]": _HF_FAMILIES,
    f"{_HF_LAYOUTS}[deepseek_v2_lite]": _HF_FAMILIES,
    f"{_HF_LAYOUTS}[nemotron]": _HF_FAMILIES,
    f"{_TE}[llama]": _TE_NAMES,
    f"{_TE}[qwen3]": _TE_NAMES,
    f"{_TE}[qwen3_moe]": _TE_NAMES,
    f"{_TE}[deepseek_v3]": _TE_NAMES,
    f"{_TE}[deepseek_v2]": _TE_NAMES,
    f"{_TE}[deepseek_v2_lite]": _TE_NAMES,
    f"{_TE}[kimi_k2]": _TE_NAMES,
    f"{_TE}[gpt_oss]": _TE_NAMES,
    f"{_TE}[nemotron]": _TE_NAMES,
    f"{_TE}[llama4_text]": _TE_NAMES,
    f"{_TE}[mixtral]": _TE_NAMES,
    # LoRA
    "tests/lora/test_zoo.py::test_lora_with_recompute_and_megatron_ep_overlap_bitwise":
        "only this trains adapters under recompute and megatron's own expert-parallel overlap; LoRA on every "
        "layout: tests/lora/test_layouts.py",
    f"{_HF_LAYOUTS}[llama4_text]": _HF_FAMILIES,
    # sharded parameters
    "tests/training/test_fsdp.py::test_dense_dp2_tp2":
        "the three strategies: test_dense_dp2, test_moe_ep2; Megatron-FSDP under TP2 with sequence parallelism "
        "and the overlap: tests/training/test_fsdp_compose.py",
    "tests/training/test_fsdp.py::test_memory_per_rank_is_one_over_dp[2]": _FSDP_MEMORY,
    "tests/training/test_fsdp.py::test_deepseek_v3_fsdp_tiny_recipe_trains":
        "MoE under every strategy: test_moe_ep2; multi-latent attention: tests/training/test_zoo.py",
    "tests/training/test_fsdp.py::test_async_save_resumes_exactly_and_is_verified":
        "the fsdp_dtensor format saved, resumed and verified: test_resume_is_exact_and_checkpoints_are_verified; "
        "asynchronous saves: tests/training/test_restart.py, tests/training/test_checkpointing.py [async]",
    "tests/training/test_fsdp.py::test_memory_per_rank_is_one_over_dp[4]": _FSDP_MEMORY,
    "tests/training/test_fsdp2.py::test_resume_is_exact_and_checkpoints_are_verified":
        "only this resumes FSDP2's checkpoint (and reads it into DDP); sharded checkpoints resumed exactly and "
        "verified: tests/training/test_fsdp.py::test_resume_is_exact_and_checkpoints_are_verified",
    "tests/training/test_fsdp2.py::test_dense_dp2_tp2":
        "FSDP2 against DDP: test_dense_dp2; only this case puts FSDP2 under TP2",
    "tests/training/test_fsdp2.py::test_moe_dp2":
        "only this puts offload and our dispatchers under FSDP2; under Megatron-FSDP's ZeRO-3: "
        "tests/training/test_fsdp.py::test_moe_ep2; FSDP2 itself: test_dense_dp2",
    "tests/training/test_fsdp_compose.py::test_moe_ep2_dp2_sharded_experts_zero_sync_with_offload":
        "zero-sync and offload bitwise under optim_grads_params: tests/training/test_fsdp.py::test_moe_ep2",
    f"{_FETCH}[ep2]": "[plain] and test_bit_identical_to_stock",
    f"{_FETCH}[full_recompute]": "[plain] and test_bit_identical_to_stock",
    # checkpoints: every damage once
    f"{_DAMAGED}[tp2pp2-missing-shard]": "[dp2-distopt-missing-shard]",
    f"{_DAMAGED}[tp2pp2-truncated-shard]": "[dp2-distopt-truncated-shard]; a resume under TP2 x PP2: "
                                           "test_resume_equals_uninterrupted_tp2_pp2",
    f"{_DAMAGED}[tp2pp2-changed-tensor-bytes]": "[dp2-distopt-changed-tensor-bytes]",
    f"{_DAMAGED}[tp2pp2-damaged-dcp-metadata]": "[dp2-distopt-damaged-dcp-metadata]",
    "tests/training/test_checkpointing.py::test_resume_equals_uninterrupted_ep2":
        "test_resume_equals_uninterrupted_ep2_overlapped_grad_reduce_and_param_gather: the same EP2 run, overlapped",
    # Megatron-LM's example scripts: each checked as written, one trained scaled down
    "tests/training/test_example_scripts.py::test_example_script_scaled_down_trains_on_cpu[llama3]":
        "[gpt3] (trained); every script as written: test_example_script_dry_run_at_its_world_size",
    "tests/training/test_example_scripts.py::test_example_script_scaled_down_trains_on_cpu[mixtral]":
        "[gpt3] (trained); every script as written: test_example_script_dry_run_at_its_world_size; MoE recipes "
        "trained: tests/moe/, tests/training/test_zoo.py",
    # offload
    f"{_LINKS}[1f1b-moe]": "[pp1-dense]; 1F1B exact: test_pp2_1f1b_dense_exact",
    f"{_LINKS}[vpp-dense]": "[pp1-dense]; virtual stages exact: test_pp2_vpp2_moe_exact_two_iterations",
    **{f"tests/offload/test_context_parallel.py::test_pp2_cp2_saves_what_the_theory_says_bitwise[{comm}]":
       "each comm type's group bytes at CP 2, byte for byte: test_each_comm_type_offloads_what_the_theory_counts; "
       "R = 1 under 1F1B: scripts/bench_offload.py --smoke (tests/test_docs.py)" for comm in ("p2p", "all_gather", "a2a")},
    "tests/offload/test_offload.py::test_train_tiny_moe_pp2_vpp2_same_losses_with_offload":
        "test_4procs_pp2_vpp2_ep2_moe_and_tp2_pp2_dense_exact (the same layout, bitwise) and "
        "test_the_log_says_once_why_a_listed_module_kept_bytes_on_the_device (train.py with offload)",
}

HEAVY_FIRST: list[str] = [
    "tests/training/test_restart.py",
    "tests/training/test_fsdp.py",
    # three that mostly wait (a dead worker's report, leak checks' settling, a deadlock's detection): early,
    # beside a heavy one, not last beside each other with both cores idle
    "tests/test_crash_stacks.py",
    "tests/test_dist.py",
    "tests/platform/test_nccl_p2p.py",
    "tests/schedules/test_overlap.py",
    "tests/planner/test_planner.py",
    "tests/training/test_zoo.py",
    "tests/test_docs.py",
    "tests/offload/test_offload.py",
    "tests/training/test_checkpointing.py",
    "tests/test_scripts.py",
    "tests/hf/test_hf.py",
    "tests/training/test_fsdp2.py",
    "tests/test_gpu_check.py",
    "tests/training/test_interrupt.py",
    "tests/hf/test_layouts.py",
    "tests/lora/test_layouts.py",
    "tests/training/test_layouts.py",
    "tests/test_entry_points.py",
]


def apply(items: list, whole_suite: bool) -> None:
    """Mark MATRIX's tests `matrix` and put HEAVY_FIRST's modules first (the rest keep their order).
    Over the whole suite, an entry that names no collected test or module is an error: a renamed
    test would silently move back into `make test`."""
    import pytest

    if whole_suite:
        ids = {item.nodeid for item in items}
        modules = {nodeid.split("::")[0] for nodeid in ids}
        stale = sorted(set(MATRIX) - ids) + sorted(set(HEAVY_FIRST) - modules)
        if stale:
            raise pytest.UsageError(f"tests/tiers.py names what the suite does not have: {', '.join(stale)}")
    for item in items:
        if item.nodeid in MATRIX:
            item.add_marker(pytest.mark.matrix)
    rank = {module: i for i, module in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def matrix_table() -> str:
    """docs/tests.md's table of MATRIX (tests/test_tiers.py keeps the page equal to it)."""
    rows = ["| test (`make test-matrix`) | what proves its property in `make test`, or what only it proves |",
            "|---|---|"]
    for nodeid, why in MATRIX.items():
        rows.append(f"| `{nodeid.removeprefix('tests/')}` | {why.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
