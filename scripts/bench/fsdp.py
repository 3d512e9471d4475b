"""Fetch and release of sharded data parallelism (ZeRO-3), per MoE layer, as a function of the number
of experts: what stock Megatron-FSDP and torch FSDP2 do on every forward + backward.

A stack of megatron-core MoE TransformerLayers (local spec, SequentialMLP experts, EP1 so every
expert is local; the decoder layers of the run's model-only bring-up) is wrapped by the stock wrapper and run forward + backward (+ the gradient sync the
training loop calls after the last micro-batch). Counted, for one step after a warm-up:

  collectives       c10d collectives dispatched (all-gathers, reduce-scatters, ...)
  host ops          aten ops the wrapper adds: ops(wrapped step) - ops(the same unwrapped model's
                    step, same weights and input), per op name; so the layer's own compute (which
                    grows with E: one GEMM pair per expert) is not in the figure
  slices / copies   the part of those that are slices and views / copies and concatenations
  post-gather       copies or concatenations that read a storage an all-gather wrote (a copy
  copies            after the gather; 0 when the parameters are views made before the collective)
  record_stream,    Tensor.record_stream calls and stream/event calls (record, wait, wait_stream,
  events            synchronize) on the stream stand-ins
  host_us           process CPU microseconds of the wrapped step minus the unwrapped step (best of
                    `timed` uncounted steps each), per layer
  released bytes    per layer in forward: the storage bytes of the layer's unsharded parameters
                    before its fetch, after it, and after its release (the storages seen after the
                    fetch, read again after the release: resized to 0 or freed counts as released);
                    `resident_after_step`: bytes of every layer's unsharded storages still held
                    after the backward

The counting machinery is scripts/bench/gather.py's (one TorchDispatchMode counting op names,
c10d collectives told apart by name); the wrappers installed here are measurement only (installed
for one measured run, removed after it), not seams.
"""
from __future__ import annotations

import collections
import contextlib
import time

import torch
from torch.overrides import TorchFunctionMode

from . import UNFUSED
from .gather import OpCounter, is_collective

DEFAULTS = dict(hidden=32, heads=4, ffn=64, moe_ffn=32, topk=2, layers=2, seq=16, mbs=2, seed=1234)
WRAPPERS = ("megatron_fsdp", "fsdp2")

SLICE_OPS = {"aten.slice", "aten.narrow", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind",
             "aten.select", "aten.as_strided", "aten.view", "aten._unsafe_view", "aten.reshape", "aten.alias",
             "aten._reshape_alias", "aten.detach", "aten.t", "aten.flatten"}
COPY_OPS = {"aten.copy_", "aten.copy", "aten.clone", "aten._to_copy", "aten.cat", "aten.stack", "aten._chunk_cat",
            "fsdp.split_with_sizes_copy", "aten.split_with_sizes_copy", "aten._foreach_copy_", "fsdp.chunk_cat",
            "fsdp.all_gather_copy_in"}


def _tensors(obj):
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensor subclasses without a storage
        return 0


# ---------------------------------------------------------------------------------------------
# The model: a stack of MoE TransformerLayers
# ---------------------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x, _ = layer(x, attention_mask=None)
        return x


def build_stack(experts: int, c: dict):
    """The decoder layers of the run's model-only bring-up (megatron_ext/training/run.py Run.for_model:
    the process groups, the model megatron-core builds from the flags) as a Stack; (stack, config)."""
    from megatron_ext.training.run import Run

    import arguments

    flags = ["--num-layers", c["layers"], "--hidden-size", c["hidden"], "--num-attention-heads", c["heads"],
             "--ffn-hidden-size", c["ffn"], "--num-experts", experts, "--moe-router-topk", c["topk"],
             "--moe-ffn-hidden-size", c["moe_ffn"], "--moe-token-dispatcher-type", "alltoall",
             "--moe-router-load-balancing-type", "none", "--disable-bias-linear", "--attention-dropout", "0",
             "--hidden-dropout", "0", "--use-cpu-initialization", "--transformer-impl", "local",
             "--position-embedding-type", "learned_absolute", "--seq-length", c["seq"],
             "--max-position-embeddings", c["seq"], "--tokenizer-type", "NullTokenizer", "--vocab-size", 1,
             "--make-vocab-size-divisible-by", 1, "--seed", c["seed"], *UNFUSED]
    run = Run.for_model([str(f) for f in flags], parse=arguments.parse)
    (model,) = run.build()
    return Stack(list(model.decoder.layers)), run.config


def wrap(stack, config, wrapper: str):
    """The stock wrapper, as megatron-core's training path builds it."""
    from megatron_ext import platform

    device = platform.current().device
    if wrapper == "megatron_fsdp":
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        ddp = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True, overlap_param_gather=True,
            # gloo has no PREMUL_SUM; NCCL runs the scaling inside the reduce-scatter.
            gradient_reduce_div_fusion=platform.current().is_cuda,
        )
        return FullyShardedDataParallel(config, ddp, stack, device=device)
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        mesh = init_device_mesh(device.type, (group.size(),)) if group.size() == torch.distributed.get_world_size() \
            else None
        # megatron.core.distributed.TorchFullyShardedDataParallel: fully_shard on every
        # TransformerLayer, then on the root.
        for layer in stack.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(stack, mesh=mesh)
        return stack
    raise ValueError(wrapper)


def release(model, wrapper: str) -> None:
    """Lets a wrapped model, and the process groups it reaches, be freed once this process is done
    with it (a benchmark or test worker builds many). Megatron-FSDP's post-accumulate-grad hooks
    (megatron_fsdp.py:1110) are held by the parameters inside autograd, where the garbage collector
    cannot see, and reach the wrapper; the parameters' own attributes (param_and_grad_buffer.py:3115)
    and the backward nodes that hold modules close more such cycles. DTensor's sharding caches hold
    the wrappers' device meshes."""
    from megatron_ext.training.model import forget_dtensor_caches, release_fsdp

    if wrapper == "megatron_fsdp":
        release_fsdp(model)
        return
    for obj in list(model.parameters()) + list(model.modules()):
        vars(obj).clear()
    forget_dtensor_caches()


def step(model, x, g, wrapper: str | None) -> None:
    """One forward + backward, and the gradient sync the training loop runs after it."""
    if wrapper == "megatron_fsdp":
        model.zero_grad_buffer()
    else:
        model.zero_grad(set_to_none=True)
    # The input requires grad, as the embedding's output does in a GPT: the first layer's
    # post-backward hook hangs on it.
    out = model(x.detach().requires_grad_(True))
    out.backward(g)
    if wrapper == "megatron_fsdp":
        model.finish_grad_sync()


# ---------------------------------------------------------------------------------------------
# Counting what the ops counter cannot see: record_stream and stream / event calls
# ---------------------------------------------------------------------------------------------
class _RecordStreamCounter(TorchFunctionMode):
    """Sees Tensor.record_stream before the CPU shim turns it into a no-op."""

    def __init__(self, tally: collections.Counter):
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.record_stream:
            self.tally["record_stream"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stream_calls(tally: collections.Counter):
    """Counts event record/wait/synchronize and stream wait_event/wait_stream/record_event calls on
    the stream classes in use (megatron's torch.cuda.* stand-ins on CPU, torch.cuda's with CUDA;
    torch's own CPU stream and event, which FSDP2 uses on CPU)."""
    classes = {torch.cuda.Event: ("record", "wait", "synchronize"),
               torch.cuda.Stream: ("wait_event", "wait_stream", "record_event", "synchronize"),
               torch.Event: ("record", "wait", "synchronize"),
               torch.Stream: ("wait_event", "wait_stream", "record_event", "synchronize")}
    undo = []
    for klass, names in classes.items():
        for name in names:
            orig = klass.__dict__.get(name)
            if orig is None or not callable(orig):
                continue

            def counted(*a, __orig=orig, __key=f"{klass.__name__}.{name}", **k):
                tally[__key] += 1
                return __orig(*a, **k)

            try:
                setattr(klass, name, counted)
            except TypeError:  # a C type's slot: not patchable
                continue
            undo.append((klass, name, orig))
    try:
        with _RecordStreamCounter(tally):
            yield tally
    finally:
        for klass, name, orig in reversed(undo):
            setattr(klass, name, orig)


# ---------------------------------------------------------------------------------------------
# Bytes of unsharded parameter storage per layer: before the fetch, after it, after the release
# ---------------------------------------------------------------------------------------------
class ReleaseProbe:
    def __init__(self, layers):
        self.layers = list(layers)
        self.handles = []
        self.seen: dict = {}  # layer index -> {storage data_ptr at fetch: storage}
        self.records: list = []
        self.active = False

    @staticmethod
    def _storages(layer) -> dict:
        out = {}
        for p in layer.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            st = t.untyped_storage()
            out[st._cdata] = st
        return out

    @staticmethod
    def _bytes(storages) -> int:
        return sum(st.nbytes() for st in storages)

    def __enter__(self):
        for i, layer in enumerate(self.layers):
            self.handles.append(layer.register_forward_pre_hook(self._before(i), prepend=True))
            self.handles.append(layer.register_forward_pre_hook(self._after_fetch(i)))
            self.handles.append(layer.register_forward_hook(self._after_release(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _before(self, i):
        def hook(module, args):
            if self.active:
                self.records.append({"layer": i, "before": self._bytes(self._storages(module).values())})

        return hook

    def _after_fetch(self, i):
        def hook(module, args):
            if self.active:
                storages = self._storages(module)
                self.seen[i] = list(storages.values())
                self.records[-1]["after_fetch"] = self._bytes(storages.values())

        return hook

    def _after_release(self, i):
        def hook(module, args, out):
            if self.active:
                self.records[-1]["after_release"] = self._bytes(self.seen[i])

        return hook

    def resident(self) -> int:
        """Bytes still held by the unsharded storages seen at every layer's fetch."""
        return sum(self._bytes(s) for s in self.seen.values())


# ---------------------------------------------------------------------------------------------
# One case, on every rank
# ---------------------------------------------------------------------------------------------
def _count_step(model, x, g, wrapper):
    """Counts one step: op names, collectives, post-gather copies, record_stream/event calls."""
    gathered: list = []  # the storages all-gathers wrote (held for the counted step only)
    post = {"copies": 0, "bytes": 0}

    def on_op(func, args, kwargs, out):
        name = str(func.overloadpacket)
        if is_collective(name) and "allgather" in name.replace("_", ""):
            gathered.extend(t.untyped_storage() for t in _tensors(args[0]))
        elif name in COPY_OPS:
            srcs = _tensors(args[1:]) if name in ("aten.copy_", "aten._foreach_copy_") else _tensors((args, kwargs))
            # A storage resized to 0 since (released) has no data: its old address may be reused.
            live = {st.data_ptr() for st in gathered if st.nbytes()}
            if any(_storage_ptr(t) in live for t in srcs):
                post["copies"] += 1
                dst = _tensors(out) or _tensors(kwargs.get("out")) or _tensors(args[:1])
                post["bytes"] += sum(t.numel() * t.element_size() for t in dst)

    tally: collections.Counter = collections.Counter()
    counter = OpCounter(on_op)
    with stream_calls(tally), counter:
        step(model, x, g, wrapper)
    return counter.ops, tally, post


def _timed(model, x, g, wrapper, n: int) -> tuple[float, float]:
    cpu, wall = [], []
    for _ in range(n):
        torch.distributed.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        step(model, x, g, wrapper)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return min(cpu), min(wall)


def _run_measured(model, layers, x, g, wrapper, timed):
    with ReleaseProbe(layers) as probe:
        step(model, x, g, wrapper)  # warm-up
        probe.active = True
        ops, tally, post = _count_step(model, x, g, wrapper)
        probe.active = False
        resident = probe.resident()
        cpu, wall = _timed(model, x, g, wrapper, timed)
    return ops, tally, post, probe, resident, cpu, wall


def measure(experts: int, wrapper: str = "megatron_fsdp", timed: int = 3, ours: bool = False, **kw) -> dict:
    """Called on every rank of a DP world (EP1); returns this rank's figures for one case."""
    from megatron_ext import platform
    from megatron_ext.training import parallel

    c = dict(DEFAULTS, **kw)
    platform.setup()
    parallel.initialize(seed=c["seed"])
    device = platform.current().device
    wrapped = None
    try:
        gen = torch.Generator().manual_seed(c["seed"] + torch.distributed.get_rank())
        x = torch.randn(c["seq"], c["mbs"], c["hidden"], generator=gen).to(device)
        g = torch.randn(c["seq"], c["mbs"], c["hidden"], generator=gen).to(device)

        bare, _ = build_stack(experts, c)
        bare.to(device)
        step(bare, x, g, None)  # warm-up
        bare_ops, _, _ = _count_step(bare, x, g, None)
        bare_cpu, bare_wall = _timed(bare, x, g, None, timed)
        del bare

        stack, config = build_stack(experts, c)
        layers = list(stack.layers)
        from megatron_ext.seams import fsdp_fetch

        # ours: the seams installed before the wrapper is built (some act on its construction),
        # as a run's build does; stock: megatron-core's code.
        with (fsdp_fetch.applied() if ours else fsdp_fetch.removed()):
            model = wrap(stack, config, wrapper)
            wrapped = (model, wrapper)
            ops, tally, post, probe, resident, cpu, wall = _run_measured(model, layers, x, g, wrapper, timed)
        L = c["layers"]
        extra = collections.Counter({k: n - bare_ops.get(k, 0) for k, n in ops.items() if n > bare_ops.get(k, 0)})
        fewer = sum(n - ops.get(k, 0) for k, n in bare_ops.items() if n > ops.get(k, 0))
        aten = {k: n for k, n in extra.items() if not k.startswith("c10d.")}
        recs = probe.records
        return {
            "rank": torch.distributed.get_rank(),
            "E": experts,
            "wrapper": wrapper,
            "impl": "ours" if ours else "stock",
            "layers": L,
            "params_per_layer": sum(p.numel() for p in layers[0].parameters()),  # DTensor: global numel
            "param_tensors_per_layer": len(list(layers[0].parameters())),
            "collectives_per_layer": sum(n for k, n in ops.items() if is_collective(k)) / L,
            "collective_names": {k: n for k, n in ops.items() if is_collective(k)},
            "host_ops_per_layer": sum(aten.values()) / L,
            "slices_per_layer": sum(n for k, n in aten.items() if k in SLICE_OPS) / L,
            "copies_per_layer": sum(n for k, n in aten.items() if k in COPY_OPS) / L,
            "post_gather_copies_per_layer": post["copies"] / L,
            "post_gather_copy_bytes_per_layer": post["bytes"] / L,
            "record_stream_per_layer": tally.get("record_stream", 0) / L,
            "event_calls_per_layer": sum(n for k, n in tally.items() if k != "record_stream") / L,
            "stream_calls": dict(tally),
            "ops_fewer_than_unwrapped": fewer,
            "host_op_names": dict(aten),
            "host_us_per_layer": max(0.0, cpu - bare_cpu) * 1e6 / L,
            "wall_us_per_layer": max(0.0, wall - bare_wall) * 1e6 / L,
            "step_cpu_s": cpu,
            "bytes_before_fetch_per_layer": sum(r["before"] for r in recs) / len(recs),
            "bytes_after_fetch_per_layer": sum(r["after_fetch"] for r in recs) / len(recs),
            "bytes_after_release_per_layer": sum(r["after_release"] for r in recs) / len(recs),
            "released_bytes_per_layer": sum(r["after_fetch"] - r["after_release"] for r in recs) / len(recs),
            "resident_after_step": resident,
            "release_records": recs,
        }
    finally:
        if wrapped:
            release(*wrapped)
        parallel.destroy()


def measure_cases(cases: list, timed: int = 3, **kw) -> list:
    """measure() for each (E, wrapper, ours) in one world (every rank); a list of this rank's figures."""
    return [measure(e, wrapper=w, ours=o, timed=timed, **kw) for e, w, o in cases]
