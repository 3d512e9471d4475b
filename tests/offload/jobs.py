"""Job functions for the offload tests and benchmark (run on every rank of a gloo world).

A tiny GPT (dense or MoE, local layer spec, fp32, no dropout) is built directly with megatron-core and
driven by megatron-core's own pipeline schedules; the same model runs with offload off and on, on the
same data, and losses / gradients / tracked device bytes are compared.
"""
from __future__ import annotations

import torch

from megatron_ext import platform

platform.setup()

from megatron.core import parallel_state  # noqa: E402

from megatron_ext.training import parallel  # noqa: E402

DEFAULTS = dict(
    model="dense", pp=1, vpp=None, tp=1, ep=1, layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
    experts=4, topk=2, moe_ffn=64, shared=0, recompute=None, recompute_layers=1, microbatches=4, seed=1234,
)


def build(**kw):
    """Initialise model parallel state and build the model chunks; returns (chunks, config, spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = dict(DEFAULTS, **kw)
    moe = c["model"] == "moe"
    parallel.initialize(tensor=c["tp"], pipeline=c["pp"], virtual_pipeline=c["vpp"], expert=c["ep"], seed=c["seed"])
    extra = {}
    if moe:
        extra = dict(
            num_moe_experts=c["experts"], moe_router_topk=c["topk"], moe_ffn_hidden_size=c["moe_ffn"],
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False,
            moe_shared_expert_intermediate_size=c["shared"] or None,
        )
    if c["recompute"] == "full":
        extra.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=c["recompute_layers"])
    elif c["recompute"]:
        extra.update(recompute_granularity="selective", recompute_modules=list(c["recompute"]))
    config = TransformerConfig(
        num_layers=c["layers"], hidden_size=c["hidden"], num_attention_heads=c["heads"], ffn_hidden_size=c["ffn"],
        tensor_model_parallel_size=c["tp"], pipeline_model_parallel_size=c["pp"],
        virtual_pipeline_model_parallel_size=c["vpp"], expert_model_parallel_size=c["ep"],
        sequence_parallel=c["tp"] > 1 and moe, attention_dropout=0.0, hidden_dropout=0.0,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, batch_p2p_comm=c["vpp"] is None,
        deallocate_pipeline_outputs=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, add_bias_linear=False, init_method_std=0.02, **extra,
    )
    spec = get_gpt_layer_local_spec(num_experts=c["experts"] if moe else None, moe_grouped_gemm=False)
    chunks = []
    for vp in range(c["vpp"] or 1):
        stage = vp if c["vpp"] else None
        chunks.append(
            GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=c["vocab"], max_sequence_length=c["seq"],
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                position_embedding_type="learned_absolute", vp_stage=stage,
            )
        )
    for ch in chunks:
        for p in ch.parameters():
            p.grad = torch.zeros_like(p)
    return chunks, config, c


def _batches(c, step: int):
    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(c["seed"] * 7 + step * 1000 + dp_rank)
    mask = torch.triu(torch.ones(1, 1, c["seq"], c["seq"], dtype=torch.bool), diagonal=1)
    pos = torch.arange(c["seq"]).unsqueeze(0).expand(c["mbs"], -1)
    out = []
    for _ in range(c["microbatches"]):
        tokens = torch.randint(0, c["vocab"], (c["mbs"], c["seq"] + 1), generator=g)
        b = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=pos, attention_mask=mask)
        out.append({k: v.to(platform.setup().device) for k, v in b.items()})
    return out


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def run_step(chunks, config, c, step: int = 0, tracker=None):
    """One forward+backward of `microbatches` micro-batches through megatron-core's schedule.
    Returns (losses, grads) with grads keyed by (chunk, name), cloned."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for ch in chunks:
        for p in ch.parameters():
            p.grad.zero_()
    batches = _batches(c, step)
    # each micro-batch is a fresh copy that only the forward holds (as a real data loader's): a
    # tensor shared by several layers (the attention mask) is then referenced by saved tensors only
    iters = [({k: v.clone() for k, v in b.items()} for b in batches) for _ in chunks]
    fb = get_forward_backward_func()
    ctx = tracker if tracker is not None else _null()
    with (_engine_backward() if c["recompute"] else _null()), ctx:
        losses = fb(
            forward_step_func=_forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=c["microbatches"],
            seq_length=c["seq"], micro_batch_size=c["mbs"], forward_only=False,
        )
    loss_vals = [x["lm loss"].item() for x in losses] if losses else []
    grads = {(i, n): p.grad.clone() for i, ch in enumerate(chunks) for n, p in ch.named_parameters()}
    return loss_vals, grads


class _engine_backward:
    """Test-side workaround, only for recompute runs: megatron-core's recompute
    (tensor_parallel/random.py:656, CheckpointFunction.backward) calls torch.autograd.backward, which
    the CPU shim's TorchFunctionMode (megatron_ext/platform/cpu_shims.py:157-159) re-enters forever
    (RecursionError, with or without offload; reported to the lead). Run that one call on the autograd
    engine directly, as megatron's own custom_backward (schedules.py:220) does."""

    def __enter__(self):
        from torch.autograd import Variable

        self._orig = torch.autograd.backward

        def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
            tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
            if grad_tensors is None:
                grad_tensors = [torch.ones_like(t) for t in tensors]
            elif isinstance(grad_tensors, torch.Tensor):
                grad_tensors = (grad_tensors,)
            Variable._execution_engine.run_backward(
                tensors, tuple(grad_tensors), bool(retain_graph or create_graph), create_graph,
                tuple(inputs or ()), allow_unreachable=True, accumulate_grad=True,
            )

        torch.autograd.backward = backward
        return self

    def __exit__(self, *a):
        torch.autograd.backward = self._orig
        return False


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _same(ga: dict, gb: dict) -> tuple[bool, list]:
    bad = [k for k in ga if not torch.equal(ga[k], gb[k])]
    return not bad and ga.keys() == gb.keys(), bad[:5]


def offload_options(modules, **kw):
    from megatron_ext.offload.manager import Options, canonical_modules

    o = dict(pool_bytes=64 << 20, chunk_bytes=16 << 10, prefetch_depth=1, min_tensor_bytes=1024, debug=True)
    o.update(kw)
    return Options(modules=canonical_modules(modules), **o)


def theory_group_bytes(modules, c) -> int:
    from megatron_ext.offload import theory
    from megatron_ext.offload.manager import canonical_modules

    return theory.group_bytes(
        canonical_modules(modules), c["model"] == "moe", seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"],
        heads=c["heads"], topk=c["topk"], moe_ffn=c["moe_ffn"], shared_ffn=c["shared"],
    )


def compare(modules=("core_attention", "qkv_linear", "attn_proj"), steps: int = 2, offload_kw=None,
            faults=(), track: bool = False, timeline: bool = False, **model_kw):
    """Offload off vs on for `steps` steps: bitwise losses and grads, stats, resident-bytes peaks."""
    from megatron_ext.offload import manager as om
    from megatron_ext.offload.memtrack import LiveBytesTracker, model_state_ptrs

    chunks, config, c = build(**model_kw)
    try:
        base = [run_step(chunks, config, c, step=s) for s in range(steps)]
        state = model_state_ptrs(chunks)
        dev = platform.setup().device.type
        t_off = LiveBytesTracker(state, dev, record_timeline=timeline) if track else None
        if track:  # the tracked step is the last one (offload on has learned the backward order by then)
            run_step(chunks, config, c, step=steps - 1, tracker=t_off)

        mgr = om.attach(chunks, offload_options(modules, **(offload_kw or {})))
        mgr._faults = set(faults)
        t_on = LiveBytesTracker(state | mgr.pool.storage_ptrs(), dev, record_timeline=timeline) if track else None
        on = []
        for s in range(steps):
            tr = t_on if s == steps - 1 else None
            on.append(run_step(chunks, config, c, step=s, tracker=tr))
            mgr.synchronize()
        stats = dict(mgr.stats)
        free_after = mgr.pool.free_slots == mgr.pool.num_slots
        idle = mgr._pending is None and not mgr._outstanding and not mgr._offloading and not mgr._returns
        om.detach()
        result = dict(
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            losses_off=[b[0] for b in base], losses_on=[o[0] for o in on],
            stats=stats, pool_all_free=free_after, manager_idle=idle,
            peak_off=t_off.peak if track else None, peak_on=t_on.peak if track else None,
            timeline_off=t_off.timeline if track else None, timeline_on=t_on.timeline if track else None,
            theory_group_bytes=theory_group_bytes(modules, c), config=c,
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            nan_grads=any(not torch.isfinite(g).all() for o in on for g in o[1].values()),
        )
        eq = [_same(b[1], o[1]) for b, o in zip(base, on)]
        result["grads_equal"] = all(e[0] for e in eq)
        result["bad_grads"] = [str(k) for e in eq for k in e[1]]
        result["losses_equal"] = result["losses_off"] == result["losses_on"]
        return result
    finally:
        om.detach()
        parallel.destroy()


def _manual_step(chunks, c, before_backward=None):
    from torch.autograd import Variable

    for p in chunks[0].parameters():
        p.grad.zero_()
    b = _batches(c, 0)[0]
    out = chunks[0](b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]).float().mean()
    if before_backward is not None:
        before_backward()
    Variable._execution_engine.run_backward((out,), (torch.ones_like(out),), False, False, (),
                                            allow_unreachable=True, accumulate_grad=True)
    return {n: p.grad.clone() for n, p in chunks[0].named_parameters()}


def reload_in_flight():
    """A group whose D2H copy is still in flight when its reload is asked for (forced here: on CPU the
    offload is reaped at once). Ours: served from the device storage it still holds. With the fault
    'reload_in_flight' (upstream #7398's behaviour) the H2D reads pool slots the D2H has not filled."""
    from megatron_ext.offload import manager as om

    results = []
    for faults in ((), ("reload_in_flight",)):
        chunks, config, c = build(layers=2, microbatches=1)
        try:
            base = _manual_step(chunks, c)
            mgr = om.attach(chunks, offload_options(("core_attention", "qkv_linear", "attn_proj")))
            mgr._faults = set(faults)

            def force():
                g = mgr._pending
                mgr._pending = None
                mgr._offload(g)
                assert g.state == "offloading"
                mgr._reload(list(g.records.values()), g)

            got = _manual_step(chunks, c, force)
            results.append(dict(
                equal=all(torch.equal(base[k], got[k]) for k in base),
                nan=any(not torch.isfinite(v).all() for v in got.values()),
                served_in_flight_bytes=mgr.stats["served_in_flight_bytes"],
                reloaded_bytes=mgr.stats["reloaded_bytes"],
            ))
        finally:
            om.detach()
            parallel.destroy()
    return results


def train_losses(argv):
    """train.main on this rank; returns its per-iteration history (losses on the last PP stage)."""
    import train

    from megatron_ext import offload

    try:
        history = train.main(list(argv))
        mgr = offload.current()
        stats = dict(mgr.stats) if mgr is not None else None
    finally:
        offload.detach()
    return dict(history=history, stats=stats, pp_rank=None)



def time_steps(modules, steps: int = 10, warmup: int = 3, offload_kw=None, **model_kw):
    """Step time with offload off and on (CUDA only: on CPU host and device are one memory), the bytes
    offloaded per step and the measured host-link bandwidth (pinned D2H copy)."""
    import time

    from megatron_ext.offload import manager as om
    from megatron_ext.platform import streams

    if not torch.cuda.is_available():
        return dict(step_time="not measured on GPU")
    chunks, config, c = build(**model_kw)

    def timed(n):
        for s in range(warmup):
            run_step(chunks, config, c, step=s)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(n):
            run_step(chunks, config, c, step=s)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    try:
        t_off = timed(steps)
        mgr = om.attach(chunks, offload_options(modules, **dict(dict(debug=False), **(offload_kw or {}))))
        t_on = timed(steps)
        per_step = mgr.stats["offloaded_bytes"] / (steps + warmup)
        om.detach()
        src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        dst = streams.host_empty(src.numel())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        bw = 5 * src.numel() / (time.perf_counter() - t0)
        return dict(step_time_off_s=t_off, step_time_on_s=t_on, overhead=(t_on - t_off) / t_off,
                    offloaded_bytes_per_step=per_step, host_link_bytes_per_s=bw,
                    copy_time_per_step_s=2 * per_step / bw)
    finally:
        om.detach()
        parallel.destroy()
