"""megatron's own checks (validate_args, the config classes' __post_init__s) -> the flags they check.

SITES holds the checks whose condition does not name the flags it checks (a local variable, a version
probe), by the condition's source text; the rest are mapped by reading the condition, with FIELD_FLAGS
mapping config fields and derived args back to their flags."""
from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from typing import Callable

from megatron_ext.config.naming import describe, name_of


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
    required = _required_value(inner, root, dests, flags)
    if required:
        return required
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


def _required_value(inner: list, root: str, dests: set, flags) -> str | None:
    """validate_args' ``_check_arg_is_not_none(args, name)``: the flag is named by the helper's
    argument, not by its condition; the site shown is the caller's line."""
    frame = inner[-1].tb_frame
    dest = frame.f_locals.get("arg") if frame.f_code.co_name == "_check_arg_is_not_none" else None
    if dest not in dests:
        return None
    caller = inner[-2] if len(inner) > 1 else inner[-1]
    where = f"{os.path.relpath(caller.tb_frame.f_code.co_filename, root)}:{caller.tb_lineno}"
    return f"{flags(dest)}: required, megatron has no default for it ({where})"


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
