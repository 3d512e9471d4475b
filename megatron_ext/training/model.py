"""Build the GPT model chunks (one per virtual-pipeline stage) as Megatron-LM's gpt_builder does
(layer specs, the multi-token-prediction block of --mtp-num-layers) and wrap them in megatron-core
DDP."""
from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.training import (
    get_megatron_ddp_config,
    resolve_ddp_bucket_size,
    wrap_model_chunks_with_ddp,
)

from megatron_ext import platform, seams
from megatron_ext.seams import registry
from megatron_ext import checkpoint


def transformer_config(args) -> TransformerConfig:
    from megatron_ext import fp8  # FP8 on the local spec: megatron's config.fp8 branches are transformer-engine's

    config = core_transformer_config_from_args(fp8.config_args(args))
    if args.multi_latent_attention:
        _mla_yarn_from_flags(args, config)
    return config


# multi-latent attention's yarn reads unprefixed config fields that no flag sets (megatron's config
# builder leaves them at MLATransformerConfig's values, training/argument_utils.py:397): the --yarn-* flags
_MLA_YARN = (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
             ("yarn_original_max_position_embeddings", "original_max_position_embeddings"))


def _mla_yarn_from_flags(args, config) -> None:
    for flag, field in _MLA_YARN:
        if getattr(args, flag, None) is not None:
            setattr(config, field, getattr(args, flag))


def _layer_spec(config: TransformerConfig, use_te: bool):
    """gpt_builders._get_transformer_layer_spec: one layer's spec from the config."""
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(
            config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
            qk_l2_norm=config.qk_l2_norm,
        )
    return get_gpt_layer_local_spec(
        config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm, config.multi_latent_attention,
        normalization=config.normalization, qk_l2_norm=config.qk_l2_norm,
    )


def layer_spec(args, config: TransformerConfig, vp_stage: int | None):
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts is not None or args.qk_norm_skip_nope_layers:  # per-layer specs
        spec = get_gpt_decoder_block_spec(  # the dense/MoE pattern of --moe-layer-freq
            config, use_transformer_engine=use_te, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )
        return _without_qk_norm_on_nope_layers(config, spec, vp_stage) if args.qk_norm_skip_nope_layers else spec
    return _layer_spec(config, use_te)


def _without_qk_norm_on_nope_layers(config: TransformerConfig, block_spec, vp_stage: int | None):
    """--qk-norm-skip-nope-layers: the layers --no-rope-freq leaves without rope get no query/key norm
    (Llama-4); megatron-core puts it on every layer. The spec's IdentityOp stands in for the norm class
    the config would pick (transformer/attention.py:1697)."""
    if config.pipeline_model_parallel_layout is not None:
        ids = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    specs = list(block_spec.layer_specs)
    assert len(specs) == len(ids), (len(specs), list(ids))
    for i, layer_id in enumerate(ids):
        if config.no_rope_freq[layer_id]:
            attention = specs[i].submodules.self_attention
            attention = dataclasses.replace(attention, submodules=dataclasses.replace(
                attention.submodules, q_layernorm=IdentityOp, k_layernorm=IdentityOp))
            specs[i] = dataclasses.replace(specs[i], submodules=dataclasses.replace(
                specs[i].submodules, self_attention=attention))
    return dataclasses.replace(block_spec, layer_specs=specs)


def mtp_spec(args, config: TransformerConfig, decoder_spec, vp_stage: int | None):
    """gpt_builder's: the MTP block reuses the spec of the decoder's last layer."""
    if args.mtp_num_layers is None:
        return None
    use_te = args.transformer_impl == "transformer_engine"
    if hasattr(decoder_spec, "layer_specs") and len(decoder_spec.layer_specs) == 0:
        last = _layer_spec(config, use_te)  # a block spec with no layer on this stage
    else:
        last = get_gpt_decoder_layer_specs(
            config, use_transformer_engine=use_te, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm,
            vp_stage=vp_stage,
        )[-1]
    return get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te, vp_stage=vp_stage)


def install_seams(args, config: TransformerConfig) -> None:
    """The seam the build needs on CUDA for the process: torch norms under sequence parallelism
    (without CUDA the CPU shim registry holds it)."""
    if platform.current().is_cuda and args.transformer_impl == "local" and config.sequence_parallel:
        seams.TORCH_NORM_SEQUENCE_PARALLEL.apply()


def build_chunks(args, config: TransformerConfig, meta: bool = False) -> list:
    """The model chunks, one per virtual pipeline stage, before any data-parallel wrapper
    (training/run.py Run.build runs the capabilities' hooks around this and wrap())."""
    install_seams(args, config)
    registry.install(args)  # this run's seams, once, before the model exists; the run's teardown removes them
    vp_size = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp_size or 1):
        stage = vp_stage if vp_size else None
        decoder_spec = layer_spec(args, config, stage)
        with torch.device("meta") if meta else contextlib.nullcontext():
            chunk = _gpt_model(args, config, decoder_spec, stage)
        if not meta:
            chunk.to(platform.current().device)
        for p in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        chunks.append(chunk)
    if args.fp16 or args.bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    # before wrapping: DDP copies the weights into its buffers, FSDP shards them (a meta model has none to draw)
    if args.layout_invariant_init and not meta:
        from megatron_ext.training.init import layout_invariant_init

        layout_invariant_init(chunks, args.init_method_std, args.seed)
    return chunks


def wrap(args, config: TransformerConfig, chunks: list) -> list:
    """The data-parallel wrapper of the run: torch FSDP2, Megatron-FSDP or megatron's DDP."""
    if args.use_torch_fsdp2:
        return wrap_fsdp2(args, config, chunks)
    if args.use_megatron_fsdp:
        return wrap_fsdp(args, config, chunks)
    return wrap_ddp(args, config, chunks)


def built(chunks: list) -> list:
    """Chunks the run's teardown releases (release_models)."""
    _BUILT.extend(chunks)
    return chunks


def freeze_all_layers(chunks) -> None:
    """--freeze-all-layers, as megatron's get_model (training/training.py:1778): no parameter
    takes a gradient, and no router updates its expert bias either."""
    for chunk in chunks:
        chunk.requires_grad_(False)
        for module in chunk.modules():
            if hasattr(module, "frozen_expert_bias"):
                module.frozen_expert_bias = True


def _gpt_model(args, config: TransformerConfig, decoder_spec, stage):
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        mtp_block_spec=mtp_spec(args, config, decoder_spec, stage),
        vp_stage=stage,
    )


_BUILT: list = []  # this run's model chunks, released by release_models() at teardown


def release_models() -> None:
    """Empty this run's DDP wrappers once the run is over. DDP's grad-accumulator hooks hold DDP
    from inside the autograd graph, which the garbage collector cannot see into; DDP reaches the
    model (as `module`, as keys of its hook handles, ...), and activations a model keeps from its
    last forward (e.g. the MoE token dispatcher's `probs`) hold that graph. Left as is, the cycle
    keeps every model of a long-lived process alive, with its process groups and their threads."""
    for chunk in _BUILT:
        if hasattr(chunk, "grad_accs"):
            vars(chunk).clear()
        elif hasattr(chunk, "megatron_fsdp_dist_index"):
            release_fsdp(chunk)
        elif hasattr(chunk, "device_mesh"):  # torch FSDP2
            release_fsdp2(chunk)
    _BUILT.clear()


def release_fsdp(chunk) -> None:
    """Empty a Megatron-FSDP wrapper: the same cycle as DDP's, through its post-accumulate-grad
    hooks (megatron_fsdp.py:1110) and the buffer closures it sets on every parameter
    (param_and_grad_buffer.py:3115); FSDP's backward nodes hold the modules themselves, so a graph
    a module keeps (the MoE dispatcher's probs) is a cycle too. DTensor's caches hold its meshes."""
    seams.wait_for_prefetched_gathers(chunk)  # before the process groups go (seams/fsdp.py)
    inner = chunk.module
    for handle in getattr(inner, "grad_acc_hooks", {}).values():
        handle.remove()
    for obj in list(inner.parameters()) + list(inner.modules()):
        vars(obj).clear()
    vars(chunk).clear()
    forget_dtensor_caches()


def release_fsdp2(chunk) -> None:
    """Empty a torch FSDP2 wrapper: fully_shard's state and hooks live on the modules and its
    DTensor parameters hold the device mesh, which holds the data-parallel group."""
    for obj in list(chunk.module.parameters()) + list(chunk.module.modules()):
        vars(obj).clear()
    vars(chunk).clear()
    forget_dtensor_caches()


def forget_dtensor_caches() -> None:
    """torch's DTensor dispatch caches the sharding of every op it has seen (in Python and in its
    native fast path), keyed by specs that hold the run's device meshes and through them its
    process groups: emptied after the run."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    debug._clear_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def wrap_ddp(args, config: TransformerConfig, chunks: list) -> list:
    """megatron-core DDP with the same config and bucketing rules as megatron.training.get_model."""
    return _wrap_chunks(args, config, chunks)


def wrap_fsdp(args, config: TransformerConfig, chunks: list) -> list:
    """Megatron-FSDP as megatron.training.get_model wraps it (training.py:1837-1895): the same DDP
    config and bucket rule, the model-parallel process groups handed over as a pg_collection."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ext.seams.fsdp import KeptBuffers

    checkpoint.load_before_sharding(args, chunks)  # --finetune from torch_dist: before the shards exist
    kept = KeptBuffers(chunks) if args.init_model_with_meta_device else None
    wrapped = _wrap_chunks(args, config, chunks, DP=FullyShardedDataParallel,
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    if kept is not None:  # materialising a meta module empties its buffers too (seams/fsdp.py)
        kept.restore()
    return wrapped


def wrap_fsdp2(args, config: TransformerConfig, chunks: list) -> list:
    """torch FSDP2 as megatron.training.get_model wraps it (training.py:1837-1872): megatron-core's
    TorchFullyShardedDataParallel (fully_shard on every TransformerLayer and embedding, then the
    root) over the data-parallel group, with get_megatron_ddp_config's
    TorchFullyShardedDataParallelConfig (--torch-fsdp2-reshard-after-forward) and no bucket size."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    return _wrap_chunks(args, config, chunks, DP=TorchFullyShardedDataParallel)


def register_fsdp_buffers(args, model: list, steps_done: int) -> None:
    """--use-nccl-ub with Megatron-FSDP: after the first step of the run its communication buffers
    are registered with NCCL, as megatron's training loop does (training.py:3913-3926)."""
    if not (args.use_megatron_fsdp and args.nccl_ub and args.fsdp_manual_registration and steps_done == 1):
        return
    for chunk in model:
        if getattr(chunk.ddp_config, "fsdp_manual_registration", False):
            chunk.param_and_grad_buffer.manual_buffer_registration()


def _wrap_chunks(args, config: TransformerConfig, chunks: list, **wrapper) -> list:
    """get_model's DDP config and per-chunk bucketing (bucketing only for the first chunk of the
    first pipeline stage), handed to megatron's wrap_model_chunks_with_ddp with ``wrapper``'s class
    and process groups."""
    ddp_config = get_megatron_ddp_config(args)
    if not args.use_torch_fsdp2:  # get_model sizes buckets for DDP and Megatron-FSDP only
        ddp_config.bucket_size = resolve_ddp_bucket_size(
            ddp_config,
            parallel_state.get_data_parallel_group(with_context_parallel=True),
            ddp_config.overlap_grad_reduce,
            num_parameters(chunks),
        )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    disable = [i > 0 or args.overlap_param_gather_with_optimizer_step for i in range(len(chunks))]
    sizes = [None if (d or pp_rank > 0) else ddp_config.bucket_size for d in disable]
    return wrap_model_chunks_with_ddp(
        chunks, config, ddp_config, bucket_sizes=sizes, disable_bucketing_per_chunk=disable, **wrapper
    )


def num_parameters(model: list) -> int:
    return sum(p.numel() for c in model for p in c.parameters())


def add_arguments(group) -> None:
    group.add_argument(
        "--qk-norm-skip-nope-layers",
        action="store_true",
        help="No query/key norm (--qk-l2-norm or --qk-layernorm) on the layers --no-rope-freq leaves "
        "without rope, as Llama-4 does; megatron-core normalises every layer's queries and keys.",
    )
    for dest, key, fixed in seams.architectures.LLAMA3_ROPE_FLAGS:
        group.add_argument(
            "--" + dest.replace("_", "-"),
            type=type(fixed),
            default=None,
            help=f"With --use-rope-scaling: the llama-3 scaling's {key.replace('_', ' ')}, which megatron-core "
            f"fixes at {fixed} (Llama-3.1's; Llama-4-Scout's high frequency factor is 1).",
        )
    group.add_argument(
        "--mla-q-proj-without-norm",
        action="store_true",
        help="Multi-latent attention without --q-lora-rank: linear_q_proj takes the layer's normalised "
        "input as it is (DeepSeek-V2-Lite); under --qk-layernorm megatron-core puts a second norm in front "
        "of it. The KV latent norm stays.",
    )


def before_validate(args) -> None:
    """Refused before megatron's validate_args, whose assertions for these would name something else."""
    from megatron_ext.errors import ConfigError

    if args.qk_norm_skip_nope_layers and not ((args.qk_l2_norm or args.qk_layernorm) and args.no_rope_freq):
        raise ConfigError(
            "--qk-norm-skip-nope-layers without --no-rope-freq and one of --qk-l2-norm / --qk-layernorm: "
            "there is no query/key norm on a layer without rope to skip"
        )
    factors = [dest for dest, _, _ in seams.architectures.LLAMA3_ROPE_FLAGS if getattr(args, dest) is not None]
    if factors and not args.use_rope_scaling:
        raise ConfigError(
            f"--{factors[0].replace('_', '-')}={getattr(args, factors[0])} without --use-rope-scaling: it is a "
            "parameter of the llama-3 rope scaling"
        )
    if args.mla_q_proj_without_norm and not (args.multi_latent_attention and args.q_lora_rank is None
                                             and args.qk_layernorm):
        raise ConfigError(
            "--mla-q-proj-without-norm needs --multi-latent-attention with --qk-layernorm and no --q-lora-rank: "
            "only then does megatron-core put a norm in front of linear_q_proj"
        )
    if args.multi_latent_attention and args.yarn_correction_range_round_to_int is False:
        raise ConfigError(
            "--no-yarn-correction-range-round-to-int with --multi-latent-attention: megatron-core's MLA yarn "
            "always rounds its correction range (transformer/multi_latent_attention.py:190)"
        )
    if args.qk_norm_skip_nope_layers and args.multi_latent_attention:
        raise ConfigError(
            "--qk-norm-skip-nope-layers with --multi-latent-attention: its query/key norms are the latent "
            "norms of MLA, which every layer needs"
        )

    if args.use_megatron_fsdp and args.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}, --use-megatron-fsdp=True: "
            "megatron-core's Megatron-FSDP lays its device mesh over the whole world as data x expert x "
            "tensor parallel ranks (distributed/fsdp/mcore_fsdp_adapter.py:561), with no pipeline dimension; use 1"
        )
