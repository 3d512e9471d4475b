"""Activation-offload measurement: a tiny GPT driven by megatron-core's own schedules, run with offload
off and on (same model, same data), comparing losses, every gradient, peak device bytes and the
theoretical saving. Used by ``scripts/bench_offload.py`` and the offload tests (as distributed jobs).

A tiny GPT (dense or MoE, local layer spec, fp32, no dropout) is built by the run's model-only bring-up.
Peak bytes: on CPU the independent tracker (``memtrack.LiveBytesTracker``), on CUDA the caching
allocator's ``max_memory_allocated`` (``memtrack.CudaPeak``). The host link of the CPU model
(``platform.faithful.link_gbps``) is set per run, either in GB/s or as a ratio of the copy time of one
layer's group to that layer's measured forward time.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from . import UNFUSED

DEFAULTS = dict(
    model="dense", pp=1, vpp=None, tp=1, ep=1, layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512, ffn=128,
    experts=4, topk=2, moe_ffn=64, shared=0, recompute=None, recompute_layers=1, microbatches=4, seed=1234,
    attention="unfused",  # the local spec's core attention (offload/theory.py ATTENTION): unfused or sdpa
    cp=1, cp_comm_type="p2p",  # context parallelism (sdpa only): megatron's --cp-comm-type
)


EXPOSED = ("exposed_copy_s", "exposed_d2h_s", "exposed_h2d_s")


def build(**kw):
    """The model chunks of the configuration, brought up by the run's model-only bring-up
    (megatron_ext/training/run.py Run.for_model: the process groups of its layout, the model chunks);
    returns (chunks, config, c). Torn down with megatron_ext.training.parallel.destroy."""
    from megatron_ext.training.run import Run

    import arguments

    c = dict(DEFAULTS, **kw)
    run = Run.for_model(model_flags(c), parse=arguments.parse)
    chunks = run.build()
    for ch in chunks:
        for p in ch.parameters():
            p.grad = torch.zeros_like(p)
    return chunks, run.config, c


def model_flags(c: dict) -> list[str]:
    """The configuration as megatron's flags: a GPT with learned positions, its own output layer, no
    biases, no dropout, the softmax in fp32, the local layer spec (sequential experts) with the core
    attention ``c["attention"]`` names (megatron's unfused, or torch's SDPA) and, for MoE, an all-to-all
    dispatcher with an aux loss."""
    moe = c["model"] == "moe"
    flags = ["--num-layers", c["layers"], "--hidden-size", c["hidden"], "--num-attention-heads", c["heads"],
             "--ffn-hidden-size", c["ffn"], "--seq-length", c["seq"], "--max-position-embeddings", c["seq"],
             "--position-embedding-type", "learned_absolute", "--disable-bias-linear", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--untie-embeddings-and-output-weights", "--attention-softmax-in-fp32",
             "--transformer-impl", "local", "--tokenizer-type", "NullTokenizer", "--vocab-size", c["vocab"],
             "--make-vocab-size-divisible-by", 1,
             "--attention-backend", {"unfused": "unfused", "sdpa": "flash"}[c["attention"]],
             "--tensor-model-parallel-size", c["tp"], "--pipeline-model-parallel-size", c["pp"],
             "--expert-model-parallel-size", c["ep"], "--seed", c["seed"], *UNFUSED]
    if c["cp"] > 1:
        flags += ["--context-parallel-size", c["cp"], "--cp-comm-type", c["cp_comm_type"]]
    if c["vpp"]:
        flags += ["--num-virtual-stages-per-pipeline-rank", c["vpp"]]
    if moe:
        flags += ["--num-experts", c["experts"], "--moe-router-topk", c["topk"], "--moe-ffn-hidden-size", c["moe_ffn"],
                  "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
                  "--moe-aux-loss-coeff", "1e-2"]
        flags += ["--moe-shared-expert-intermediate-size", c["shared"]] if c["shared"] else []
        flags += ["--sequence-parallel"] if c["tp"] > 1 else []
    if c["recompute"] == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                  c["recompute_layers"]]
    elif c["recompute"]:
        flags += ["--recompute-granularity", "selective", "--recompute-modules", *c["recompute"]]
    flags += {"float32": [], "bfloat16": ["--bf16"], "float16": ["--fp16"]}[c.get("dtype", "float32")]
    return [str(f) for f in flags]


def batches(c, step: int):
    from megatron.core import parallel_state

    from megatron_ext import platform

    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(c["seed"] * 7 + step * 1000 + dp_rank)
    mask = torch.triu(torch.ones(1, 1, c["seq"], c["seq"], dtype=torch.bool), diagonal=1)
    pos = torch.arange(c["seq"]).unsqueeze(0).expand(c["mbs"], -1)
    out = []
    for _ in range(c["microbatches"]):
        tokens = torch.randint(0, c["vocab"], (c["mbs"], c["seq"] + 1), generator=g)
        b = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], position_ids=pos)
        if c["cp"] == 1:  # under context parallelism the causal triangle is the attention's (as train.py's)
            b["attention_mask"] = mask
        b = {k: v.to(platform.current().device) for k, v in b.items()}
        if c["cp"] > 1:  # megatron's split of the sequence over the context-parallel ranks
            from megatron.core.utils import get_batch_on_this_cp_rank

            b = get_batch_on_this_cp_rank(b, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group())
        out.append(b)
    return out


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b.get("attention_mask"), labels=b["labels"])

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
    data = batches(c, step)
    # each micro-batch is a fresh copy that only the forward holds (as a real data loader's): a
    # tensor shared by several layers (the attention mask) is then referenced by saved tensors only
    iters = [({k: v.clone() for k, v in b.items()} for b in data) for _ in chunks]
    fb = get_forward_backward_func()
    with tracker if tracker is not None else contextlib.nullcontext():
        losses = fb(
            forward_step_func=_forward_step, data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=c["microbatches"],
            seq_length=c["seq"], micro_batch_size=c["mbs"], forward_only=False,
        )
    loss_vals = [x["lm loss"].item() for x in losses] if losses else []
    grads = {(i, n): p.grad.clone() for i, ch in enumerate(chunks) for n, p in ch.named_parameters()}
    return loss_vals, grads


def _same(ga: dict, gb: dict) -> tuple[bool, list]:
    bad = [k for k in ga if not torch.equal(ga[k], gb[k])]
    return not bad and ga.keys() == gb.keys(), bad[:5]


def offload_options(modules, **kw):
    """The benchmarks' offload options: a small pool of small chunks, every tensor of 1 KiB or more,
    debug on; ``kw`` as OffloadOptions' fields."""
    from megatron_ext.offload import OffloadOptions, canonical_modules

    o = dict(pool_mb=64.0, chunk_mb=1 / 64, prefetch_depth=1, min_tensor_kb=1.0, debug=True)
    o.update(kw)
    return OffloadOptions(modules=list(canonical_modules(modules)), **o)


def theory_group_bytes(modules, c) -> int:
    from megatron_ext.offload import canonical_modules, theory

    return theory.group_bytes(
        canonical_modules(modules), c["model"] == "moe", seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"],
        heads=c["heads"], topk=c["topk"], moe_ffn=c["moe_ffn"], shared_ffn=c["shared"], ffn=c["ffn"],
        dtype_bytes=torch.finfo(getattr(torch, c.get("dtype", "float32"))).bits // 8, attention=c["attention"],
        cp=c["cp"], cp_comm_type=c["cp_comm_type"],
    )


def theoretical_bytes(c, group: int, pp_rank: int, prefetch_depth: int, peak: str = "layer_backward") -> int:
    """The saving offload/theory.py models for this rank, with the step's peak where ``peak`` says."""
    from megatron_ext.offload import theory

    return theory.theoretical_saving(group, c["pp"], c["vpp"], pp_rank, c["microbatches"], _per_chunk(c),
                                     prefetch_depth, peak)


def resident(c, pp_rank: int, prefetch_depth: int, peak: str = "layer_backward") -> list:
    """What offload/theory.py says stays on the device at that peak: [{"what", "groups", "why"}]."""
    import dataclasses

    from megatron_ext.offload import theory

    return [dataclasses.asdict(r) for r in theory.resident_at_peak(
        c["pp"], c["vpp"], pp_rank, c["microbatches"], _per_chunk(c), prefetch_depth, peak)]


def _per_chunk(c) -> int:
    return c["layers"] // (c["pp"] * (c["vpp"] or 1))


class LayerClock:
    """Host time of every TransformerLayer forward that records for backward (CPU only: on CUDA
    the host runs ahead of the device)."""

    def __init__(self, chunks):
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.times: list = []
        self._t0 = {}
        self._handles = []
        for ch in chunks:
            for m in ch.modules():
                if isinstance(m, TransformerLayer):
                    self._handles.append(m.register_forward_pre_hook(self._pre))
                    self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, m, _a):
        if torch.is_grad_enabled():
            self._t0[id(m)] = time.perf_counter()

    def _post(self, m, _a, _o):
        t0 = self._t0.pop(id(m), None)
        if t0 is not None:
            self.times.append(time.perf_counter() - t0)

    def median(self) -> float:
        ts = sorted(self.times)
        return ts[len(ts) // 2] if ts else 0.0

    def remove(self):
        for h in self._handles:
            h.remove()


class LayerEventClock:
    """Time of every TransformerLayer's forward and backward that records for backward, from events on
    the compute stream (CUDA events; on CPU the platform's stand-ins, host time): the compute an
    offload copy overlaps. A layer's backward runs from the gradient of its output to the gradient of
    its input. Counts only while ``active``."""

    def __init__(self, chunks):
        from megatron.core.transformer.transformer_layer import TransformerLayer

        self.active = False
        self.forward: list = []  # (start, end) events
        self.backward: list = []
        self._handles = []
        for ch in chunks:
            for m in ch.modules():
                if isinstance(m, TransformerLayer):
                    self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
                    self._handles.append(m.register_forward_hook(self._post))

    @staticmethod
    def _event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _pre(self, m, args, kwargs):
        if not (self.active and torch.is_grad_enabled()):
            return
        x = args[0] if args else kwargs.get("hidden_states")
        call = dict(start=self._event())
        m._clock_call = call
        if isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(lambda g, call=call: self._backward_end(call))

    def _post(self, m, _args, out):
        call = getattr(m, "_clock_call", None)
        if call is None:
            return
        del m._clock_call
        self.forward.append((call["start"], self._event()))
        y = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(lambda g, call=call: call.__setitem__("bwd_start", self._event()))

    def _backward_end(self, call):
        if "bwd_start" in call:
            self.backward.append((call.pop("bwd_start"), self._event()))

    def medians_s(self) -> tuple:
        """(median layer forward, median layer backward) in seconds, over every layer timed so far."""
        import statistics

        f = [a.elapsed_time(b) / 1e3 for a, b in self.forward]
        b = [a.elapsed_time(e) / 1e3 for a, e in self.backward]
        return (statistics.median(f) if f else 0.0), (statistics.median(b) if b else 0.0)

    def remove(self):
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def link(gbps: float | None):
    """Run the CPU copy engine at ``gbps`` (None: leave the setting as it is)."""
    from megatron_ext.platform import faithful

    old = os.environ.get(faithful.LINK_ENV)
    if gbps is not None:
        os.environ[faithful.LINK_ENV] = repr(float(gbps))
    try:
        yield
    finally:
        if gbps is not None:
            if old is None:
                os.environ.pop(faithful.LINK_ENV, None)
            else:
                os.environ[faithful.LINK_ENV] = old


def _link_gbps(spec, group: int, layer_s: float):
    """A link spec: None (as configured), a number (GB/s), or "xR": one group's copy takes R times
    one layer's measured forward."""
    if isinstance(spec, str) and spec.startswith("x"):
        return group / (float(spec[1:]) * layer_s) / 1e9
    return None if spec is None else float(spec)


def compare(modules=("core_attention", "qkv_linear", "attn_proj"), steps: int = 2, offload_kw=None,
            faults=(), track: bool = False, timeline: bool = False, links=(None,), peak: str = "layer_backward",
            **model_kw):
    """Offload off vs on for `steps` steps: bitwise losses and grads, stats, resident-bytes peaks.

    One model build, one run with offload off, then one run with offload on per entry of ``links``
    (see ``_link_gbps``). Returns the first run's results at top level and every run in ``runs``.
    ``peak``: where the step's peak falls, for the theoretical saving R divides by (offload/theory.py:
    inside a layer's backward, or the logits gradient when the vocabulary outweighs a layer)."""
    from megatron.core import parallel_state

    from megatron_ext import platform
    from megatron_ext.measure.memtrack import CudaPeak, LiveBytesTracker, model_state_ptrs
    from megatron_ext.offload import manager as om
    from megatron_ext.platform import faithful, streams
    from megatron_ext.training import parallel

    chunks, config, c = build(**model_kw)
    offload_kw = dict(offload_kw or {})
    deferred = offload_kw.pop("deferred_copies", None)  # the CPU copy streams' mode (OffloadManager)
    opts = offload_options(modules, **offload_kw)
    try:
        clock = LayerClock(chunks)  # a link given as a ratio is set against the measured step's own compute
        base = [run_step(chunks, config, c, step=s) for s in range(steps)]
        state = model_state_ptrs(chunks)
        dev = platform.current().device.type
        cuda = dev == "cuda"

        def tracker(extra=()):
            if not track:
                return None
            return CudaPeak() if cuda else LiveBytesTracker(state | set(extra), dev, record_timeline=timeline)

        t_off = tracker()
        if track:  # the tracked step is the last one (offload on has learned the backward order by then)
            clock.times.clear()
            run_step(chunks, config, c, step=steps - 1, tracker=t_off)
        clock.remove()
        layer_s = clock.median()
        group = theory_group_bytes(modules, c)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        theo = theoretical_bytes(c, group, pp_rank, opts.prefetch_depth, peak)
        runs = []
        for spec in links:
            gbps = _link_gbps(spec, group, layer_s)
            with link(gbps):
                mgr = om.attach(chunks, opts, deferred)
                mgr._faults = set(faults)
                t_on = tracker(mgr.pool.storage_ptrs())
                on = []
                for s in range(steps):
                    if s == steps - 1:  # exposed copy time and wall time: the measured step's own
                        exposed0 = {k: mgr.stats[k] for k in EXPOSED}
                        t0 = time.perf_counter()
                    on.append(run_step(chunks, config, c, step=s, tracker=t_on if s == steps - 1 else None))
                    mgr.synchronize()
                step_s = time.perf_counter() - t0
                last = dict(mgr.stats)
                free_after = mgr.pool.free_slots == mgr.pool.num_slots
                idle = mgr._pending is None and not mgr.order.outstanding and not mgr._offloading and not mgr._alive
                om.detach()
                threads_left = streams.worker_threads()
            eq = [_same(b[1], o[1]) for b, o in zip(base, on)]
            saved = (t_off.peak - t_on.peak) if track else None
            run = dict(
                link_gbps=(gbps if gbps is not None else faithful.link_gbps()) if faithful.enabled() else None,
                link_spec=spec, losses_on=[o[0] for o in on], stats=last, pool_all_free=free_after,
                manager_idle=idle, threads_left=threads_left, step_s=step_s, peak_on=t_on.peak if track else None,
                timeline_on=t_on.timeline if track else None, saved_bytes=saved,
                R=(saved / theo) if (track and theo) else None,
                **{k: (last[k] - exposed0[k] if not cuda else None) for k in EXPOSED},
                grads_equal=all(e[0] for e in eq), bad_grads=[str(k) for e in eq for k in e[1]],
                nan_grads=any(not torch.isfinite(g).all() for o in on for g in o[1].values()),
            )
            run["losses_equal"] = run["losses_on"] == [b[0] for b in base]
            run["copy_to_compute"] = (group / (gbps * 1e9) / layer_s) if (gbps and layer_s and not cuda) else None
            runs.append(run)
        result = dict(
            pp_rank=pp_rank, pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
            losses_off=[b[0] for b in base], peak_off=t_off.peak if track else None,
            timeline_off=t_off.timeline if track else None, theory_group_bytes=group, theoretical_bytes=theo,
            resident=resident(c, pp_rank, opts.prefetch_depth, peak),
            layer_forward_s=layer_s, config=c, runs=runs,
        )
        return dict(runs[0], **result)
    finally:
        om.detach()
        parallel.destroy()


def time_steps(modules, steps: int = 10, warmup: int = 3, offload_kw=None, **model_kw):
    """CUDA only: step time with offload off and on (CUDA events on the compute stream), peak
    device bytes of one step each (max_memory_allocated), bytes offloaded per step and the measured
    host-link bandwidth (pinned D2H copy)."""
    from megatron_ext.measure.memtrack import CudaPeak
    from megatron_ext.offload import manager as om
    from megatron_ext.platform import streams
    from megatron_ext.training import parallel

    if not torch.cuda.is_available():
        return dict(step_time="not measured on GPU")
    chunks, config, c = build(**model_kw)

    def timed(n):
        for s in range(warmup):
            run_step(chunks, config, c, step=s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for s in range(n):
            run_step(chunks, config, c, step=s)
        end.record()
        torch.cuda.synchronize()
        peak = CudaPeak()
        run_step(chunks, config, c, step=0, tracker=peak)
        return start.elapsed_time(end) / 1e3 / n, peak.peak

    try:
        t_off, peak_off = timed(steps)
        opts = offload_options(modules, **dict(dict(debug=False), **(offload_kw or {})))
        mgr = om.attach(chunks, opts)
        t_on, peak_on = timed(steps)
        per_step = mgr.stats["offloaded_bytes"] / (steps + warmup + 1)
        om.detach()
        src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        dst = streams.host_empty(src.numel())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        bw = 5 * src.numel() / (start.elapsed_time(end) / 1e3)
        group = theory_group_bytes(modules, c)
        theo = theoretical_bytes(c, group, 0, opts.prefetch_depth)
        return dict(device=torch.cuda.get_device_name(), model=c, step_time_off_s=t_off, step_time_on_s=t_on,
                    overhead=(t_on - t_off) / t_off, peak_off_bytes=peak_off, peak_on_bytes=peak_on,
                    saved_bytes=peak_off - peak_on, theoretical_bytes=theo,
                    R=(peak_off - peak_on) / theo if theo else None,
                    offloaded_bytes_per_step=per_step, host_link_bytes_per_s=bw,
                    copy_time_per_step_s=2 * per_step / bw)
    finally:
        om.detach()
        parallel.destroy()
