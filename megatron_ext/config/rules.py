"""RULES: cross-field rules, in the order they are checked: parallel layout, model shape, batch,
schedule, platform (transformer-engine / CUDA), files on disk. Each refusal is one line: the flags
with their values, then what is allowed."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ext.config.ledger import not_here
from megatron_ext.config.naming import describe, name_of


def target(args):
    """Is CUDA / transformer-engine / apex there, for this validation: every platform rule asks here.
    The machine running it, or the ``--platform`` target of a ``--dry-run``
    (megatron_ext/platform/target.py)."""
    from megatron_ext.platform.target import resolve

    return resolve(args)


_NOT_TORCHAO = {
    "delayed": "torchao has no delayed scaling; use tensorwise, or transformer-engine",
    "blockwise": "torchao's float8 training has no blockwise recipe; use tensorwise, or transformer-engine",
    "mxfp8": "mxfp8 needs transformer-engine",
    "custom": "a custom quantizer factory builds transformer-engine quantizers; use tensorwise, or transformer-engine",
}


def _local_fp8_recipe(a) -> str | None:
    """Why --fp8-recipe cannot run on the local spec (megatron_ext/fp8: torchao's tensorwise float8), or None."""
    return _NOT_TORCHAO.get(a.fp8_recipe)


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


def _moe(a):
    return bool(a.num_experts)


def _recompute_modules(a):
    return a.recompute_modules or []


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
    Rule("schedule", ("lr",), lambda a: a.lr is not None,
         "--lr is required: megatron's learning-rate schedule starts from it (there is no default)"),
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
         lambda a: a.transformer_impl in ("local", "transformer_engine")
         and (a.transformer_impl == "local" or target(a).te),
         "FP8 runs in transformer-engine's kernels (--transformer-impl transformer_engine, installed) or in "
         "torchao's float8 products on the local spec (--transformer-impl local, megatron_ext/fp8)",
         when=lambda a: a.fp8 is not None),
    Rule("platform", ("fp8_recipe", "transformer_impl"), lambda a: _local_fp8_recipe(a) is None,
         "the local spec's FP8 is torchao's float8 training with tensorwise scaling (--fp8-recipe tensorwise); "
         "the other recipes are transformer-engine's", when=lambda a: a.fp8 is not None and a.transformer_impl == "local",
         detail=_local_fp8_recipe),
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
           when=lambda a, d=dest: getattr(a, d) and not a.mock_data and not a.sft)  # --sft: JSON lines (sft/)
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
    *(Rule("files", (dest,), lambda a, d=dest: _writable_dir(getattr(a, d)),
           "must be a directory this user can create or write (it is written before the first step)",
           when=lambda a, d=dest: getattr(a, d, None))
      for dest in ("tensorboard_dir", "data_cache_path", "wandb_save_dir")),
    # --- what megatron's parser accepts that this loop does not do (the rest: ledger.py, check_not_here) --
    Rule("not here", ("distributed_backend",),
         lambda a: a.distributed_backend == ("nccl" if target(a).cuda else "gloo"),
         "the backend follows the device here: nccl with CUDA, gloo without (megatron_ext/platform)",
         when=lambda a: a.config_sources.get("distributed_backend") in ("cli", "recipe")),
    Rule("not here", ("rerun_mode",), lambda a: a.rerun_mode != "report_stats",
         "megatron's rerun state machine is driven by its own training loop; a non-finite loss stops the "
         "run here (--check-for-nan-in-loss-and-grad), and nothing is re-run"),
    Rule("not here", ("transformer_impl",), lambda a: a.transformer_impl != "inference_optimized",
         "the inference-optimized layer spec is for megatron's inference engine; train with local or "
         "transformer_engine"),
    Rule("not here", ("attention_backend", "transformer_impl"),
         lambda a: str(getattr(a.attention_backend, "name", a.attention_backend)) != "local",
         "megatron's GPT builder swaps transformer-engine's core attention for its local one under "
         "--attention-backend local; this loop does not: use --transformer-impl local",
         when=lambda a: a.transformer_impl == "transformer_engine"),
    Rule("files", ("yaml_cfg",), lambda a: a.yaml_cfg is None,
         "megatron's --yaml-cfg replaces the whole command line; give a --recipe (its keys merge under "
         "the command line's flags)"),
    Rule("files", ("spec",), lambda a: a.spec is None,
         "a layer-spec module is not loaded by this loop (it builds megatron's local or "
         "transformer-engine GPT spec from --transformer-impl); drop --spec"),
    Rule("files", ("save",), lambda a: _writable_dir(a.save),
         "--save must be a directory this user can create or write", when=lambda a: a.save),
    Rule("files", ("load",), lambda a: _readable_dir(a.load) or not _exists(a.load),
         "--load must be a readable directory", when=lambda a: a.load),
    Rule("files", ("pretrained_checkpoint",), lambda a: _readable_dir(a.pretrained_checkpoint),
         "--pretrained-checkpoint must be a readable directory", when=lambda a: getattr(a, "pretrained_checkpoint", None)),
)


def check_not_here(args, actions: dict, refused=()) -> list[str]:
    """A refusal line for each flag the ledger refuses whenever set (megatron_ext/config/ledger.py):
    set, here, means a value other than the parser's default. Not for a flag already ``refused``."""
    lines = []
    for dest, why in not_here().items():
        action = actions.get(dest)
        if action is not None and dest not in refused and getattr(args, dest, action.default) != action.default:
            lines.append(f"{describe(args, (dest,), functools.partial(name_of, actions))}: not in this loop: {why}")
    return lines


def check_rules(args, actions: dict, stage: str, refused=()) -> list[str]:
    """Every cross-field rule the arguments break, as refusal lines. A rule reading a flag already
    refused (``refused``: dests outside their domain) is not checked: its value is going to change."""
    lines = []
    for rule in RULES:
        if rule.stage != stage or {*rule.flags, *rule.context} & set(refused):
            continue
        try:
            broken = rule.when(args) and not rule.ok(args)
        except ArithmeticError:  # a size already refused (0) that the rule divides by
            if refused:
                continue
            raise
        if broken:
            allowed = rule.allowed + (f" ({rule.detail(args)})" if rule.detail else "")
            set_context = [d for d in rule.context if getattr(args, d, None) != actions[d].default]
            if rule.family == "platform" and "transformer-engine" in rule.allowed and not target(args).declared:
                from megatron_ext.platform.target import CLUSTER_HINT

                allowed += "; " + CLUSTER_HINT.format(hint="--assume-te")
            lines.append(f"{describe(args, (*rule.flags, *set_context), functools.partial(name_of, actions))}: {allowed}")
    return lines
