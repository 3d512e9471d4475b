"""One traced micro-batch of the tiny model: every storage's life (allocated at op i, found dead at op
j, n bytes), which storages are saved for backward (by component and offload module), the
components' forward / backward op ranges, the parameters and megatron's global buffer requests.
See megatron_ext/planner/trace.py."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Tagger:
    """Which component runs, forward and backward; every storage saved outside the offload
    manager's hooks is recorded with it. A storage that a layer's linear (a GEMM transformer-engine
    runs in FP8 when asked; not the output layer) saves as its input is marked: FP8 keeps that
    input in one byte per element."""

    def __init__(self, model, exclude):
        from megatron_ext.offload.targets import offload_layers

        self.exclude = exclude
        self.current = "embedding"
        self.saved: dict = {}  # the tracker's storage index -> [component, offload module, GEMM input]
        self.handles = []
        self.marks: list = []  # (tracker op index, component, "F"/"B")
        self.tracker = None
        self.gemm_inputs: list = []  # per linear being run: its inputs' storage addresses
        self.layers = offload_layers(model)
        for name, module in model.named_modules():
            if _is_layer_gemm(name, module):
                self.handles.append(module.register_forward_pre_hook(self._enter_gemm))
                self.handles.append(module.register_forward_hook(self._leave_gemm))
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._enter(f"layer{i}")))
            self.handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self._leave_layer(i, o)))
        emb = getattr(model, "embedding", None)
        if emb is not None:
            self.handles.append(emb.register_forward_hook(lambda m, a, o: self._grad_mark(o, "embedding")))

    def _enter_gemm(self, module, args):
        self.gemm_inputs.append({t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)})

    def _leave_gemm(self, module, args, output):
        self.gemm_inputs.pop()

    def _enter(self, name):
        self.current = name
        self.marks.append((self.tracker.ops, name, "F"))

    def _leave_layer(self, i, out):
        nxt = "head" if i == len(self.layers) - 1 else f"layer{i + 1}"
        self._grad_mark(out, f"layer{i}")
        self.current = nxt
        self.marks.append((self.tracker.ops, nxt, "F"))

    def _grad_mark(self, out, name):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: self.marks.append((self.tracker.ops, name, "B")))

    def pack(self, t):
        if isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return t
        self.observe(t, None)
        return t

    def observe(self, t, module) -> None:
        """A tensor saved for backward (the offload manager's observer: ``module`` is the offload
        module whose hooks saw it; None outside them)."""
        self.record(t.untyped_storage().data_ptr(), module)

    def record(self, ptr, module) -> None:
        """A storage saved for backward (keyed by the tracker's index: a freed address may be reused)."""
        k = self.tracker.ids.get(ptr)
        if k is None:  # not allocated by the step (its inputs) or excluded (parameters)
            return
        gemm = bool(self.gemm_inputs) and ptr in self.gemm_inputs[-1]
        rec = self.saved.get(k)
        if rec is None:
            self.saved[k] = [self.current, module, "only" if gemm else None]
            return
        if rec[1] != module:
            rec[1] = "shared"  # saved by two places: offloading one frees nothing
        if rec[2] != ("only" if gemm else None):
            rec[2] = "shared"  # also kept by something else: its FP8 copy comes on top

    def remove(self):
        """Unhook, and drop what the hooks reach: a model keeps tensors of its last forward (the MoE
        dispatcher's probabilities), whose graph holds the tensor hooks and, through them, this
        object; the model and its process groups must not be reachable from there."""
        for h in self.handles:
            h.remove()
        self.handles, self.layers, self.tracker = [], [], None


def _is_layer_gemm(name: str, module) -> bool:
    """A decoder layer's tensor-parallel linear (attention, MLP, experts, shared experts, latent
    projections): transformer-engine linears in the cluster's spec. The output layer stays a
    megatron linear there, outside FP8."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and ".layers." in f".{name}"


def _component_of(param_name: str) -> str:
    if ".layers." in param_name:
        return "layer" + param_name.split(".layers.")[1].split(".")[0]
    if param_name.startswith("embedding"):
        return "embedding"
    return "head"


class _AllocTracker:
    """The live-bytes tracker, also keeping every storage's life as [first op, op at which it was
    found dead, bytes] in the order storages appear, so that the timeline can be replayed with each
    storage re-sized."""

    def __new__(cls, exclude, device_type):
        from megatron_ext.measure.memtrack import LiveBytesTracker

        class Tracker(LiveBytesTracker):
            def __init__(self):
                super().__init__(exclude, device_type)
                self.allocs: list = []
                self.ids: dict = {}  # ptr -> index in allocs, while alive

            sweep_every_op = True  # the op at which each storage died is part of the trace

            def _sweep(self):
                expired = torch.UntypedStorage._expired
                for ptr, (ref, _n) in list(self.live.items()):
                    if expired(ref.cdata):
                        self.current -= self.live.pop(ptr)[1]
                        k = self.ids.pop(ptr, None)
                        if k is not None:
                            self.allocs[k][1] = self.ops

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.func = func.__name__
                return super().__torch_dispatch__(func, types, args, kwargs)

            def _run(self, func, args, kwargs):
                return _without_gemm_values(func, args, kwargs)

            def _see(self, t):
                before = len(self.live)
                super()._see(t)
                if len(self.live) > before:
                    ptr = t.untyped_storage().data_ptr()
                    self.ids[ptr] = len(self.allocs)
                    self.allocs.append([self.ops, None, self.live[ptr][1], self.func])

        return Tracker()


def _without_gemm_values(func, args, kwargs):
    """``func`` run, except that a matrix product's output is zeros of the shape, dtype, strides and
    device it would have: the trace reads sizes and lives, never values (the routing is balanced
    whatever the logits), and the GEMMs were most of its time on CPU (bfloat16 experts)."""
    kwargs = kwargs or {}
    if func not in _gemms():
        return func(*args, **kwargs)
    device = args[0].device
    meta = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device).zero_()


@functools.cache
def _gemms() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})


class _GemmShapesOnly(TorchDispatchMode):
    """The untracked first step's GEMMs, as the tracked step runs them (``_without_gemm_values``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _without_gemm_values(func, args, kwargs)


def global_buffer_bytes() -> int:
    """Bytes of megatron's global memory buffer (sequence-parallel all-gathers reuse it; it stays)."""
    from megatron.core import parallel_state

    try:
        buf = parallel_state.get_global_memory_buffer()
    except AssertionError:
        return 0
    return sum(t.untyped_storage().nbytes() for t in buf.buffer.values())


def run_once(tiny, kinds, seed: int = 1234) -> dict:
    """Build the tiny model of ``tiny`` (planner/tiny.py ``TinyRun``: its arguments already shrunk), run
    one micro-batch forward and backward. Returns the storages' lives (allocs), which of them are saved
    (by component and offload module), the component phases (op ranges, forward and backward) and the
    parameters. A MoE model routes balanced (``megatron_ext.seams.planner``): every expert gets the same
    tokens. Under context parallelism the sequence is one rank's share and attention attends as that
    rank (``attention.context_parallel.simulated``)."""
    from megatron_ext.attention import context_parallel
    from megatron_ext.seams.planner import balanced_routing, transformer_engine_saves
    from megatron_ext.training import Run

    args = tiny.args
    args.seed = seed  # the tiny copy's own arguments (planner/tiny.py trace_args)
    routing = balanced_routing() if args.num_experts else contextlib.nullcontext()
    attention = transformer_engine_saves() if tiny.fused_attention else contextlib.nullcontext()
    # the run's model-only bring-up: the tiny copy's model, no optimizer or data (training/run.py)
    with Run(args, model_only=True) as run, routing, attention, context_parallel.simulated(tiny.context_parallel):
        return _run_built(run, kinds, seed, tiny.budget_rows_per_token)


def _run_built(run, kinds, seed: int, budget_rows_per_token: float | None) -> dict:
    from megatron_ext import moe
    from megatron_ext.measure.memtrack import model_state_ptrs
    from megatron_ext.offload import MODULES, OffloadOptions
    from megatron_ext.offload.manager import OffloadManager
    from megatron_ext.seams import unwrapped
    from megatron_ext.seams.planner import buffer_requests

    args = run.args
    chunks = run.build()  # the bare chunks: no data-parallel wrapper
    if budget_rows_per_token is not None:  # the fixed-budget dispatcher's buffers as the run's, per token
        moe.size_buffers(chunks, budget_rows_per_token)
    model = chunks[0]
    root = unwrapped(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    exclude = model_state_ptrs(chunks)
    params = {}
    for name, p in root.named_parameters():
        params.setdefault(_component_of(name), []).append(
            (name, p.numel() * p.element_size(), ".experts." in name and "shared_experts" not in name))
    g = torch.Generator().manual_seed(seed)
    s, b = args.seq_length, args.micro_batch_size
    dev = next(model.parameters()).device
    tokens = torch.randint(0, args.padded_vocab_size, (b, s + 1), generator=g).to(dev)
    pos = torch.arange(s, device=dev).unsqueeze(0).expand(b, -1).contiguous()
    # the data loader's causal mask where the run has one (torch attention's runs have none: its kernels
    # apply the triangle, attention/__init__.py; given, CUDA would take flex_attention for it)
    mask = (torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool, device=dev), diagonal=1)
            if args.create_attention_mask_in_dataloader else None)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    tagger = _Tagger(root, exclude)
    # the offload manager's hook placement, recording what each module saves instead of offloading it
    manager = OffloadManager(OffloadOptions(modules=list(MODULES), min_tensor_kb=0.0), observer=tagger.observe)
    manager.attach(chunks)
    tracker = _AllocTracker(exclude, dev.type)
    tagger.tracker = tracker
    # a first step untracked, as a run's measured step follows others: what persists across
    # steps (megatron's global buffer for sequence-parallel gathers, cached rotary tables) exists
    # before it and is counted once, as buffers
    with _GemmShapesOnly():
        model(inputs, pos, mask, labels=labels).float().mean().backward()
    for p in model.parameters():
        p.grad.zero_()
    tagger.marks.clear()
    try:
        with tracker, buffer_requests() as requests:
            with torch.autograd.graph.saved_tensors_hooks(tagger.pack, lambda x: x):
                tagger.marks.append((0, "embedding", "F"))
                out = model(inputs, pos, mask, labels=labels)
                loss = out.float().mean()
            end_fwd = tracker.ops
            tagger.marks.append((end_fwd, "head", "B"))
            del out
            loss.backward()
            tracker._sweep()
            end = tracker.ops
    finally:
        manager.detach()
        manager.observer = None
        tagger.remove()
    comps = ["embedding"] + [f"layer{i}" for i in range(len(kinds))] + ["head"]
    # alloc index -> (component, offload module or None, GEMM input: None / "only" / "shared")
    saved = {k: (comp, None if module == "shared" else module, gemm) for k, (comp, module, gemm) in tagger.saved.items()}
    phases = {(w, c): [] for w in "FB" for c in comps}
    for which, stop in (("F", end_fwd), ("B", end)):
        marks = [(i, c) for i, c, k in tagger.marks if k == which] + [(stop, None)]
        for (i0, c), (i1, _) in zip(marks, marks[1:]):
            if c is not None and i1 > i0:
                phases[(which, c)].append((i0, i1))
    return dict(allocs=[tuple(a) for a in tracker.allocs], saved=saved, phases=phases, params=params,
                comps=comps, ops=end, peak=tracker.peak, kinds=list(kinds), buffers=global_buffer_bytes(),
                requests=list(requests))
