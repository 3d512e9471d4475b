"""LoRA adapters: the base model frozen, low-rank adapters trained on its linears. See docs/finetune.md.

``--lora-rank R`` turns it on. Before the data-parallel wrapper is built (``before_wrap``), every
targeted linear gets its adapter (``megatron_ext.lora.adapters``: the math under every parallel
layout), every adapter's A is drawn from its global checkpoint key and --seed (the same adapter on
any layout), B is zeros, and every other parameter is frozen: DDP, Megatron-FSDP and FSDP2 lay out
gradient buffers for the adapters only, and the optimizer holds state for them only.

Parameter names (what a peft import or export maps; docs/finetune.md):
``<linear path>.lora.<part>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]), global shapes;
``<part>`` is ``q`` / ``k`` / ``v`` on linear_qkv, ``gate`` / ``up`` on a gated linear_fc1 (canonical form),
``all`` elsewhere and for the linears --lora-fused-adapters names (all of them without names). Examples:
``decoder.layers.0.self_attention.linear_qkv.lora.k.lora_B.weight``,
``decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.lora.gate.lora_A.weight`` (in the model;
its checkpoint key ``decoder.layers.mlp.experts.experts.linear_fc1.lora.gate.lora_A.weight`` holds every
layer and expert on leading axes, as megatron keys the weights), ``decoder.layers.1.mlp.router.lora.all.lora_B.weight``.

Checkpoints (``megatron_ext.lora.checkpoint``) hold the adapters and their optimizer state only, with
the base checkpoint they apply to recorded.
"""
from __future__ import annotations

from megatron_ext.config.typed import add_group
from megatron_ext.errors import ConfigError
from megatron_ext.lora import targets
from megatron_ext.lora.options import LoRAOptions

FLAG = "--lora-rank"

__all__ = ["LoRAOptions", "add_arguments", "validate", "before_wrap", "merge", "teardown", "enabled", "FLAG"]


def add_arguments(parser):
    add_group(parser, LoRAOptions, "megatron_ext: LoRA", "low-rank adapters on a frozen base (docs/finetune.md)")
    return parser


def enabled(args) -> bool:
    return LoRAOptions.from_args(args).enabled


def scale(args) -> float:
    return LoRAOptions.from_args(args).scale


def default_targets(args) -> list:
    """Every attention and MLP linear the model has: linear_qkv (or multi-latent attention's
    projections), linear_proj, linear_fc1, linear_fc2."""
    found = {path.rsplit(".", 1)[-1] for path in targets.model_paths(args)}
    return [name for name in targets.NAMES if name in found and name != targets.ROUTER]


ALL_LINEAR = targets.ALL_LINEAR  # peft's name for every linear of the model: here the defaults and the router


def target_list(args) -> list:
    given = list(args.lora_target_modules or [])
    if not given:
        return default_targets(args)
    if ALL_LINEAR in given:
        extra = [targets.ROUTER] if args.num_experts else []
        return default_targets(args) + extra + [t for t in given if t != ALL_LINEAR]
    return given


def chosen(args) -> list:
    """The targets (target_list), each resolved to megatron's linear and part (targets.resolve)."""
    return targets.resolve_all(target_list(args), args)


def fused(args, path: str) -> bool:
    """Is the linear at target path ``path`` adapted in the fused form?"""
    names = args.lora_fused_adapters
    return names is not None and (not names or any(targets.names(path, n) for n in _fused_names(args)))


def _fused_names(args) -> list:
    """--lora-fused-adapters' names as megatron's (peft's resolved; what does not resolve is refused
    by validate)."""
    out = []
    for given in args.lora_fused_adapters or []:
        try:
            name = targets.resolve(given, args).name
        except ConfigError:
            continue
        if name is not None:
            out.append(name)
    return out


def _outs(args, path: str, parts: list) -> list:
    """Output features of each adapter of the linear at ``path`` (its canonical parts, or one)."""
    return [sum(n for _, n in parts)] if fused(args, path) else [n for _, n in parts]


def validate(args) -> None:
    opts = LoRAOptions.from_args(args)  # the rank >= 1, alpha > 0 and dropout in [0, 1) are their domains (options.py)
    if not opts.enabled:
        off = LoRAOptions()
        for name in ("alpha", "dropout", "target_modules", "rslora", "fused_adapters"):
            value = getattr(opts, name)
            if value != getattr(off, name):
                shown = " ".join(value) if isinstance(value, list) else value
                raise ConfigError(f"{LoRAOptions.flag(name)}={shown}: needs {FLAG}")
        return
    _validate_platform(args)
    matched = _validate_targets(args)
    _validate_layout(args, matched)


def _validate_platform(args) -> None:
    on = f"{FLAG}={args.lora_rank}"
    if args.transformer_impl != "local":
        raise ConfigError(f"{on} with --transformer-impl={args.transformer_impl}: the adapters attach to the "
                          "local spec's linears; transformer-engine's fuse the input norm into the linear "
                          "(the adapter's input is the norm's output); use --transformer-impl local")
    if args.init_model_with_meta_device:
        raise ConfigError(f"{on} with --init-model-with-meta-device: the adapters are drawn and the base frozen "
                          "before the data-parallel wrapper, and a meta-device model has no storage then")
    if args.freeze_all_layers:
        raise ConfigError(f"{on} with --freeze-all-layers: LoRA freezes every base weight itself")
    sharded = "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-torch-fsdp2" if args.use_torch_fsdp2 else None
    if sharded and args.save:
        raise ConfigError(f"--save={args.save}, {on}, {sharded}=True: adapter-only checkpoints are written from "
                          "DDP models (with or without the distributed optimizer); train the adapters there, or "
                          "under this wrapper without --save")
    if sharded and args.load and not args.finetune:
        raise ConfigError(f"--load={args.load}, {on}, {sharded}=True: resuming adapters is for DDP models; "
                          "load the base with --finetune --load and train from there")


def _validate_targets(args) -> dict:
    """{target: [(path, in, parts)]} of the model's linears each target names; refuses every target
    LoRA does not adapt or the model lacks at once (each with the closest name it has), a part of a
    linear adapted in the fused form, and a rank above a targeted linear's width."""
    paths = targets.model_paths(args)
    have = sorted({p.split("decoder.layers.", 1)[-1] for p in paths})
    matched, problems = {}, []
    for given in target_list(args):
        try:
            target = targets.resolve(given, args)
        except ConfigError as e:
            problems.append(str(e))
            continue
        hits = [(p, fin, parts) for p, (fin, parts) in paths.items() if targets.matches(p, parts, target)]
        if not hits:
            close = targets.closest(target.given, _names_of(paths, args))
            problems.append(f"--lora-target-modules={target.given}: this model has no such linear"
                            f"{'; did you mean ' + close + '?' if close else ''} (it has: {', '.join(have)})")
            continue
        if target.part is not None:
            whole = [p for p, _, _ in hits if fused(args, p)]
            if whole:
                problems.append(f"--lora-target-modules={target.given} with --lora-fused-adapters: "
                                f"{whole[0].split('decoder.layers.', 1)[-1]} has one adapter over all its rows, "
                                f"not a {target.part} part; name the whole linear ({whole[0].rsplit('.', 1)[-1]}) "
                                "or leave it out of --lora-fused-adapters")
        matched[target.given] = hits
    for name in args.lora_fused_adapters or []:
        try:
            target = targets.resolve(name, args, "--lora-fused-adapters")
        except ConfigError as e:
            problems.append(str(e))
            continue
        if target.part is not None:
            problems.append(f"--lora-fused-adapters={name}: a fused adapter spans a whole linear, not its "
                            f"{target.part} part; name {target.name.rsplit('.', 1)[-1]}")
        elif target.name is None or not any(targets.names(p, target.name) for hits in matched.values()
                                            for p, _, _ in hits):
            problems.append(f"--lora-fused-adapters={name}: names none of the linears LoRA adapts here")
    if problems:
        raise ConfigError("\n".join(problems))
    r = args.lora_rank
    for target, hits in matched.items():
        for path, fin, parts in hits:
            width = min([fin] + _outs(args, path, parts))
            if r > width:
                raise ConfigError(f"{FLAG}={r}: above the width of {path.split('decoder.layers.', 1)[-1]} "
                                  f"({width}): a rank-{r} adapter of it is not low-rank")
    return matched


def _names_of(paths: dict, args) -> list:
    """The target names this model has: megatron's leaves and peft's that resolve onto them."""
    leaves = {p.rsplit(".", 1)[-1] for p in paths}
    out = sorted(leaves)
    for name in targets.PEFT_NAMES:
        try:
            t = targets.resolve(name, args)
        except ConfigError:
            continue
        if any(targets.matches(p, parts, t) for p, (_, parts) in paths.items()):
            out.append(name)
    return out


def _validate_layout(args, matched: dict) -> None:
    on = f"{FLAG}={args.lora_rank}"
    paths = [p for hits in matched.values() for p, _, _ in hits]
    qkv = any(p.endswith("self_attention.linear_qkv") and not fused(args, p) for p in paths)
    experts = any(".experts." in p for p in paths)
    if qkv:
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        tp = args.tensor_model_parallel_size
        if groups < tp:
            raise ConfigError(f"--tensor-model-parallel-size={tp} with {on} on linear_qkv: its {groups} query "
                              "groups do not split over the ranks (a rank holds part of a group's rows), so "
                              "the separate q / k / v adapters have no shard; use --lora-fused-adapters")
        if args.attention_output_gate:
            raise ConfigError(f"--attention-output-gate with {on} on linear_qkv: the canonical q / k / v adapters "
                              "have no part for the gate rows; use --lora-fused-adapters")
    if experts and args.moe_grouped_gemm:
        raise ConfigError(f"--moe-grouped-gemm with {on} on the routed experts: the adapters attach to each "
                          "expert's linear (SequentialMLP); the grouped-GEMM experts hold one weight tensor")
    if experts and args.moe_zero_sync_dropless:
        if args.lora_dropout:
            raise ConfigError(f"--lora-dropout={args.lora_dropout} with --moe-zero-sync-dropless on the routed "
                              "experts: the grouped experts run on a fixed-size buffer, so dropout would draw "
                              "other numbers than per expert; use 0 there")
        elem = 2 if (args.bf16 or args.fp16) else 4
        if (args.lora_rank * elem) % 16:
            raise ConfigError(f"{on} with --moe-zero-sync-dropless on the routed experts: the grouped GEMM needs "
                              f"rows of a multiple of 16 bytes (a rank that is a multiple of {16 // elem} in "
                              "this precision)")


def adapter_elements(args) -> dict:
    """{"dense": (dense, expert), "moe": (...)}: the adapter elements one decoder layer of each kind
    holds on one rank (tensor parallelism splitting a column adapter's B and a row adapter's A; the
    routed experts' for this rank's experts, split over expert-TP), for the planner: the adapters'
    gradients and optimizer state are all a LoRA run keeps of them."""
    r = args.lora_rank
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    ep = args.expert_model_parallel_size
    named = chosen(args)
    out = {"dense": [0.0, 0.0], "moe": [0.0, 0.0]}
    for path, (fin, parts) in targets.model_paths(args).items():
        if targets.parts_adapted(path, named) == set():
            continue
        outs = _outs(args, path, parts)
        name = path.rsplit(".", 1)[-1]
        routed = ".mlp.experts." in path
        split = etp if routed else tp
        if name == targets.ROUTER:
            n = r * fin + r * outs[0]
        elif name in targets.ROW_PARALLEL:
            n = r * fin / split + sum(r * o for o in outs)
        else:
            n = r * fin * len(outs) + sum(r * o / split for o in outs)
        if routed:
            n *= args.num_experts / ep
        kinds = ("dense", "moe") if ".self_attention." in path else ("dense",) if ".mlp.linear_" in path else ("moe",)
        for kind in kinds:
            out[kind][1 if routed else 0] += n
    return {k: tuple(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# the hook the model builder calls before the data-parallel wrapper
# ---------------------------------------------------------------------------------------------
def before_wrap(args, chunks: list) -> None:
    """Attach the adapters to ``chunks`` (unwrapped model chunks), draw them, freeze the rest."""
    if not enabled(args):
        return
    from megatron_ext.lora import attach

    attach.attach(args, chunks, chosen(args), scale(args), lambda path: fused(args, path))


def merge(chunks: list) -> int:
    """The adapters of ``chunks`` merged into their base weights and removed (lora/attach.py)."""
    from megatron_ext.lora import attach

    return attach.merge(chunks)


def teardown() -> None:
    from megatron_ext.lora import attach

    attach.forget()


def summary(args) -> str:
    """The startup summary's line (training/features.py): the adapters, or off."""
    if not enabled(args):
        return f"lora: off (no {FLAG})"
    return (f"lora: rank {args.lora_rank}, scale {scale(args):g}{' (rsLoRA)' if args.lora_rslora else ''}, "
            f"dropout {args.lora_dropout:g}; on {' '.join(target_list(args))}; the base frozen")
