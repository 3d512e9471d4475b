"""Put the adapters on a built model: find the targeted linears, give each its ``lora`` child, shadow
its forward and checkpoint entries (megatron_ext/seams/lora.py), draw the adapters, freeze the rest."""
from __future__ import annotations

import torch

from megatron_ext import platform, seams
from megatron_ext.errors import ConfigError
from megatron_ext.lora import adapters, targets

_ATTACHED: list = []  # (module, kind) of this run, for forget()
_HOOKS: list = []



def _spec(args, config, tpath: str, linear, parallel: str, rank: int, scale: float, fused: bool) -> adapters.Spec:
    name = tpath.rsplit(".", 1)[-1]
    out_local, in_local = linear.weight.shape
    glu = name == "linear_fc1" and config.gated_linear_unit
    common = dict(parallel=parallel, in_local=in_local, rank=rank, scale=scale, dropout=args.lora_dropout,
                  expert=bool(getattr(linear, "is_expert", False)))
    if name == "linear_qkv" and not fused:
        tp = linear.tp_group.size()
        d = config.kv_channels
        heads, groups = config.num_attention_heads // tp, config.num_query_groups // tp
        return adapters.Spec(parts=(("q", heads * d), ("k", groups * d), ("v", groups * d)), layout="qkv",
                             qkv=(groups, heads // groups, d), **common)
    if glu and not fused:
        return adapters.Spec(parts=(("gate", out_local // 2), ("up", out_local // 2)), layout="glu", **common)
    return adapters.Spec(parts=(("all", out_local),), layout="single", glu_fused=glu and parallel == "column",
                         **common)


def _mark(adapter: adapters.LinearAdapter, linear, sequence_parallel: bool) -> None:
    """The tensor-parallel attributes megatron's optimizer, gradient norm, DDP and finalize_model_grads
    read: a sharded factor is ``tensor_model_parallel`` on its axis; a replicated one that sees only a
    sequence shard is ``sequence_parallel``; an expert's factors are reduced over the expert
    data-parallel group (``allreduce`` False, as the expert's weight)."""
    from megatron.core.tensor_parallel.layers import (
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    spec = adapter.spec
    allreduce = getattr(linear.weight, "allreduce", True)
    for pair in adapter.pairs():
        a, b = pair.lora_A.weight, pair.lora_B.weight
        if spec.parallel == "column":
            set_tensor_model_parallel_attributes(b, True, 0, 1)
        elif spec.parallel == "row":
            set_tensor_model_parallel_attributes(a, True, 1, 1)
        for p in (a, b):
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            p.allreduce = allreduce
        replicated = {"column": (a,), "row": (b,), "replicated": (a, b)}[spec.parallel]
        for p in replicated:
            p.sequence_parallel = sequence_parallel


def attach(args, chunks: list, chosen: list, scale: float, fused) -> None:
    """``chosen``: the targets (targets.Target: megatron's linear and the part each names); ``scale``:
    the adapters' alpha / rank; ``fused(path)``: is the linear at that target path adapted in the fused
    form (all as the package's entry point settles them from the flags). A part of a linear that no
    target names (k when the targets are q_proj and v_proj) is drawn zero: A = B = 0 adds nothing and
    gets zero gradients, so it stays zero (peft has no adapter there)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.router import TopKRouter

    rank = args.lora_rank
    hits = dict.fromkeys([t.given for t in chosen], 0)
    trainable, inert = set(), []
    for chunk in chunks:
        model = seams.unwrapped(chunk)
        config = model.config
        for path, module in list(model.named_modules()):
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, TopKRouter)):
                continue
            tpath = targets.target_path(path)
            named = [t for t in chosen if t.name is not None and targets.names(tpath, t.name)]
            if not named:
                continue
            for t in named:
                hits[t.given] += 1
            if isinstance(module, TopKRouter):
                adapter = _router_adapter(args, module, rank, scale)
            else:
                adapter = _linear_adapter(args, config, tpath, module, rank, scale, fused(tpath))
            trainable.update(id(p) for p in adapter.parameters())
            parts = targets.parts_adapted(tpath, named)
            if parts is not None:
                inert.extend(getattr(adapter, name) for name, _ in adapter.spec.parts if name not in parts)
        if _embedding_needs_grad(args):
            _HOOKS.extend(seams.lora.embedding_output_needs_grad(model))
    _refuse_unmatched(hits)
    adapters.init_adapters(chunks, args.seed)
    with torch.no_grad():
        for pair in inert:
            pair.lora_A.weight.zero_()
            pair.lora_B.weight.zero_()
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(id(p) in trainable)


def _linear_adapter(args, config, tpath: str, linear, rank: int, scale: float, fused: bool):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    name = tpath.rsplit(".", 1)[-1]
    row = isinstance(linear, RowParallelLinear)
    if (row and not linear.input_is_parallel) or (not row and linear.gather_output):
        raise ConfigError(f"--lora-target-modules: {name} is built with its input scattered or its output "
                          "gathered by the linear itself; LoRA adapts linears inside tensor-parallel regions")
    spec = _spec(args, config, tpath, linear, "row" if row else "column", rank, scale, fused)
    weight = linear.weight
    adapter = adapters.LinearAdapter(spec, weight.dtype, weight.device)
    linear.add_module("lora", adapter)
    explicit = bool(getattr(linear, "explicit_expert_comm", False))
    _mark(adapter, linear, bool(linear.sequence_parallel) and linear.tp_group.size() > 1 and not explicit)

    def forward(base, input_, *a, **k):
        output, bias = base(input_, *a, **k)
        return output + linear.lora.delta(linear, input_), bias

    def sharded_state_dict(base, prefix, sharded_offsets, metadata):
        state = {k: v for k, v in base(prefix, sharded_offsets, metadata).items()
                 if not k.startswith(f"{prefix}lora.")}
        state.update(linear.lora.checkpoint_entries(linear, prefix, sharded_offsets, metadata))
        return state

    seams.lora.adapt_linear(linear, forward, sharded_state_dict)
    _ATTACHED.append((linear, "linear"))
    return adapter


def _router_adapter(args, router, rank: int, scale: float):
    """The router's logits plus the adapter's (both factors replicated, like the router's weight;
    under sequence parallelism each rank routes its own tokens, so both are ``sequence_parallel``)."""
    weight = router.weight
    spec = adapters.Spec(parallel="replicated", parts=(("all", weight.shape[0]),), in_local=weight.shape[1],
                         rank=rank, scale=scale, dropout=args.lora_dropout, layout="single")
    adapter = adapters.LinearAdapter(spec, weight.dtype, weight.device)
    router.add_module("lora", adapter)
    _mark(adapter, router, bool(router.config.sequence_parallel))

    def gating(base, input):
        logits = base(input)
        return logits + router.lora.delta(router, input).to(logits.dtype)

    seams.lora.adapt_router(router, gating)
    # the router's own sharded_state_dict (MegatronModule's default) walks its children: the
    # adapter's entries come out replicated, which is what both of its factors are
    _ATTACHED.append((router, "router"))
    return adapter


def _embedding_needs_grad(args) -> bool:
    """With the embedding frozen, nothing before the first adapter needs a gradient. Two of
    megatron's paths need it to: a checkpoint (recompute) function, whose output needs a gradient
    only if an input does (seams/lora.py), and the combined-1F1B plan of
    --overlap-moe-expert-parallel-comm, whose embedding node runs a backward of its own
    (models/common/model_chunk_schedule_plan.py:609)."""
    return bool(args.recompute_granularity or args.moe_layer_recompute
                or args.overlap_moe_expert_parallel_comm)


def _refuse_unmatched(hits: dict) -> None:
    """A target that named no linear on any rank (the flags allowed it; the model built has none)."""
    counts = torch.tensor([hits[t] for t in hits], dtype=torch.int64, device=platform.current().device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    missing = [t for t, n in zip(hits, counts.tolist()) if n == 0]
    if missing:
        raise ConfigError("\n".join(f"--lora-target-modules={t}: the model built has no such linear" for t in missing))


@torch.no_grad()
def merge(chunks: list) -> int:
    """W <- W + scale * B @ A (in fp32, cast back to W's dtype) on every adapted linear and router of
    ``chunks``, each module then back to megatron-core's own forward and checkpoint entries with its
    adapter removed: the merged model, under the base's names. Returns how many merged."""
    merged = 0
    for chunk in chunks:
        for module in list(seams.unwrapped(chunk).modules()):
            adapter = getattr(module, "lora", None)
            if not isinstance(adapter, adapters.LinearAdapter):
                continue
            module.weight.copy_((module.weight.float() + adapter.weight_delta()).to(module.weight.dtype))
            del module.lora
            kind = "router" if "gating" in module.__dict__ else "linear"
            (seams.lora.restore_router if kind == "router" else seams.lora.restore_linear)(module)
            _ATTACHED[:] = [entry for entry in _ATTACHED if entry[0] is not module]
            merged += 1
    return merged


def forget() -> None:
    """Back to megatron-core's own forward on every module this run adapted."""
    for handle in _HOOKS:
        handle.remove()
    _HOOKS.clear()
    for module, kind in _ATTACHED:
        (seams.lora.restore_router if kind == "router" else seams.lora.restore_linear)(module)
    _ATTACHED.clear()
