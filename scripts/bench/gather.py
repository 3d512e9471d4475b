"""The sharded-parameter gather / reduce path: counting what megatron-core's DDP buffers do per step.

The distributed optimizer keeps every parameter as a view into one contiguous buffer per
(dtype, expert/dense) and communicates per *bucket* of that buffer (param_and_grad_buffer.py).
This module measures whether that holds on our recipes:

    with GatherProbe() as probe:          # wraps the bucket-group methods (the "sync path")
        ...train steps...                  # probe.begin_step(count=True/False) before each
    probe.steps                            # per step: collectives, aten ops, syncs, host seconds

`count=True` steps run a TorchDispatchMode inside the sync path only (aten ops and c10d
collectives are both dispatcher ops, so one mode sees both); `count=False` steps only time the
path, so the mode's own overhead is not in the host-time figure. Whole-step collectives (MoE
all-to-all, loss and grad-norm all-reduces) and the optimizer's ops are counted as separate regions
so the sync-path numbers are not mixed with them.

`measure(argv, ...)` runs the training loop train.py runs (megatron_ext/training/run.py), with the
probe on the run's points, and returns one rank's figures; scripts/bench_gather.py and
tests/training/test_sharded_params.py call it on every rank of a gloo world. The probe's wrappers
are measurement only (installed for one measured run, removed after it), not seams.
"""
from __future__ import annotations

import collections
import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The bucket-group methods that make up the gather / reduce path (megatron-core 0.19.2,
# megatron/core/distributed/param_and_grad_buffer.py): start_param_sync :377, finish_param_sync
# :532, start_grad_sync :594, finish_grad_sync :781, _post_param_sync :301 (also reached from
# DistributedDataParallel._start_bucket_group_param_sync, distributed_data_parallel.py:516).
SYNC_METHODS = ("start_grad_sync", "finish_grad_sync", "start_param_sync", "finish_param_sync", "_post_param_sync")
SYNC_OP = "aten._local_scalar_dense"  # a device->host read (.item()): a sync on a GPU


def _is_collective(name: str) -> bool:
    return name.startswith("c10d.") and not name.startswith("c10d.wait")


is_collective = _is_collective


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op by name (aten ops and c10d collectives alike) while active;
    ``on_op(func, args, kwargs, out)``, if given, sees each op as well."""

    def __init__(self, on_op=None):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1
        out = func(*args, **kwargs)
        if self.on_op is not None:
            self.on_op(func, args, kwargs, out)
        return out


class _Mode(TorchDispatchMode):
    """Counts every dispatched op into the probe's current region."""

    def __init__(self, probe: "GatherProbe"):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.probe._record(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class GatherProbe:
    """Installs pass-through wrappers on the bucket-group methods and on the optimizer step while
    active; restores the originals on exit."""

    def __init__(self):
        self.steps: list[dict] = []
        self._region = "step"
        self._depth = 0
        self._counting = False
        self._mode = None
        self._undo = []
        self._cur = None
        self._in_bucket = False

    # ---- per step ---------------------------------------------------------------------------
    def begin_step(self, count: bool) -> None:
        self._counting = count
        self._cur = {
            "counted": count,
            "ops": collections.Counter(),  # (region, op name) -> n
            "sync_s": 0.0,  # wall seconds in the path (includes waiting for the collectives)
            "sync_cpu_s": 0.0,  # this thread's CPU seconds in the path: host-side work only
            "sync_calls": 0,  # top-level calls into megatron's bucket-group methods
        }

    def end_step(self) -> dict:
        cur, self._cur = self._cur, None
        self._counting = False
        out = {k: cur[k] for k in ("counted", "sync_s", "sync_cpu_s", "sync_calls")}
        if cur["counted"]:
            by_region = collections.defaultdict(collections.Counter)
            for (region, name), n in cur["ops"].items():
                by_region[region][name] += n
            for region in ("sync", "optimizer", "step"):
                ops = by_region.get(region, collections.Counter())
                out[f"{region}_collectives"] = sum(n for k, n in ops.items() if _is_collective(k))
                out[f"{region}_ops"] = sum(n for k, n in ops.items() if k.startswith("aten."))
                out[f"{region}_syncs"] = ops.get(SYNC_OP, 0)
                out[f"{region}_op_names"] = dict(ops)
        self.steps.append(out)
        return out

    def _record(self, name: str) -> None:
        if self._cur is not None:
            self._cur["ops"][(self._region, name)] += 1

    @contextlib.contextmanager
    def region(self, name: str, timed: bool = False):
        """Ops inside are attributed to `name` (the outermost region of that name wins)."""
        if self._region == name:
            yield
            return
        prev, self._region = self._region, name
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._region = prev
            if timed and self._cur is not None:
                self._cur["sync_s"] += time.perf_counter() - t0
                self._cur["sync_cpu_s"] += time.thread_time() - c0

    # ---- install / remove -------------------------------------------------------------------
    def __enter__(self):
        from megatron.core.distributed import param_and_grad_buffer as pgb
        from megatron.core.optimizer import distrib_optimizer, optimizer

        cls = pgb._ParamAndGradBucketGroup
        for name in SYNC_METHODS:
            self._wrap(cls, name, "sync", timed=True)
        # DistributedOptimizer.step is inherited from MixedPrecisionOptimizer (optimizer.py).
        for klass in (
            optimizer.ChainedOptimizer, optimizer.MixedPrecisionOptimizer, optimizer.FP32Optimizer,
            distrib_optimizer.DistributedOptimizer,
        ):
            if "step" in vars(klass):
                self._wrap(klass, "step", "optimizer", timed=False)
        self._mode = _Mode(self)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self, klass, name: str, region: str, timed: bool) -> None:
        orig = vars(klass)[name]
        probe = self

        def wrapper(obj, *args, **kwargs):
            if region == "sync" and probe._cur is not None and not probe._in_bucket:
                probe._cur["sync_calls"] += 1
                probe._in_bucket = True
                try:
                    return probe._run(orig, region, timed, obj, *args, **kwargs)
                finally:
                    probe._in_bucket = False
            return probe._run(orig, region, timed, obj, *args, **kwargs)

        wrapper.__wrapped__ = orig
        setattr(klass, name, wrapper)
        self._undo.append(lambda: setattr(klass, name, orig))

    def _run(self, orig, region, timed, *args, **kwargs):
        if self._cur is None or self._region == region:
            return orig(*args, **kwargs)
        with self.region(region, timed=timed):
            if self._counting and not self._depth:
                self._depth += 1
                try:
                    with self._mode:
                        return orig(*args, **kwargs)
                finally:
                    self._depth -= 1
            return orig(*args, **kwargs)

    def time_forward_pre_hooks(self, model) -> int:
        """Put DDP's registered forward pre-hooks (the param-gather entry point, one per module)
        inside the sync region; returns how many were wrapped."""
        n = 0
        for chunk in model:
            for module, handle in getattr(chunk, "remove_forward_pre_hook_handles", {}).items():
                fn = module._forward_pre_hooks[handle.id]

                def timed(*a, __fn=fn, **k):
                    return self._run(__fn, "sync", True, *a, **k)

                module._forward_pre_hooks[handle.id] = timed
                n += 1
        return n

    @contextlib.contextmanager
    def whole_step(self):
        """Count everything dispatched during a counted step (forward, backward, optimizer)."""
        if self._counting:
            self._depth += 1
            try:
                with self._mode:
                    yield
            finally:
                self._depth -= 1
        else:
            yield


# ---------------------------------------------------------------------------------------------
# Buffers: are the params views into the contiguous buffers?
# ---------------------------------------------------------------------------------------------
def buffer_report(model: list) -> dict:
    """Per DDP buffer: params that are views of param_data / main_grad views of grad_data, buckets."""
    out = {"buffers": 0, "buckets": 0, "bucket_groups": 0, "params": 0, "param_views": 0, "grad_views": 0,
           "param_tensors": 0, "param_bytes": 0, "expert_params": 0}
    for chunk in model:
        buffers = list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))
        out["bucket_groups"] += len(getattr(chunk, "bucket_groups", [])) + len(
            getattr(chunk, "expert_parallel_bucket_groups", [])
        )
        expert_buffers = {id(b) for b in getattr(chunk, "expert_parallel_buffers", [])}
        for buf in buffers:
            out["expert_params"] += sum(p.numel() for p in buf.params) if id(buf) in expert_buffers else 0
            out["buffers"] += 1
            out["buckets"] += len(buf.buckets)
            pstore = buf.param_data.untyped_storage().data_ptr() if buf.param_data is not None else None
            gstore = buf.grad_data.untyped_storage().data_ptr()
            for p in buf.params:
                out["params"] += p.numel()
                out["param_tensors"] += 1
                out["param_bytes"] += p.numel() * p.element_size()
                out["param_views"] += int(pstore is not None and p.untyped_storage().data_ptr() == pstore)
                out["grad_views"] += int(p.main_grad.untyped_storage().data_ptr() == gstore)
    return out


# ---------------------------------------------------------------------------------------------
# One measured training run (called on every rank)
# ---------------------------------------------------------------------------------------------
DDP_KEYS = ("overlap_grad_reduce", "overlap_param_gather", "ddp_num_buckets", "ddp_bucket_size")


class _Measurement:
    """The probe on a run's points (megatron_ext/training/run.py): the build and the wrapper timed,
    the wrapper's ops counted, the sharded-parameter seams installed or removed after the build,
    and every step timed (the counted ones through the GatherProbe's dispatch mode)."""

    def __init__(self, probe: GatherProbe, result: dict, counted_steps: int, seams: bool, ddp_defaults: bool):
        self.probe, self.result, self.counted_steps = probe, result, counted_steps
        self.seams, self.ddp_defaults = seams, ddp_defaults

    def after_parse(self, run):
        if self.ddp_defaults:
            args = run.args
            args.overlap_grad_reduce = args.overlap_param_gather = False
            args.ddp_num_buckets = args.ddp_bucket_size = None
            args.use_distributed_optimizer = True

    @contextlib.contextmanager
    def around_build(self, run):
        t0 = time.perf_counter()
        yield
        self.result["init_s"] = time.perf_counter() - t0

    @contextlib.contextmanager
    def around_wrap(self, run):
        counter = OpCounter()
        t0 = time.perf_counter()
        with counter:
            yield
        self.result["ddp_init_s"] = time.perf_counter() - t0
        self.result["ddp_init_ops"] = sum(n for k, n in counter.ops.items() if k.startswith("aten."))
        self.result["ddp_init_copies"] = counter.ops.get("aten.copy_", 0)

    def after_build(self, run):
        from megatron.core import parallel_state

        from megatron_ext.seams import registry as seam_mod

        chunks = run.model
        if self.seams:
            seam_mod.install_sharded_params_seams(chunks)
        else:
            seam_mod.remove_sharded_params_seams(chunks)
        self.result["buffers"] = rep = buffer_report(chunks)
        ep = parallel_state.get_expert_model_parallel_world_size()
        self.result["global_params"] = rep["params"] - rep["expert_params"] + ep * rep["expert_params"]
        self.result["forward_pre_hooks"] = self.probe.time_forward_pre_hooks(chunks)

    @contextlib.contextmanager
    def around_step(self, run, iteration):
        self.probe.begin_step(1 < iteration <= 1 + self.counted_steps)
        t0 = time.perf_counter()
        with self.probe.whole_step():
            yield
        s = self.probe.end_step()
        s["step_s"] = time.perf_counter() - t0
        s["iteration"] = iteration


def measure(argv: list[str], counted_steps: int = 1, timed_steps: int = 3, seams: bool = True,
            ddp_defaults: bool = False) -> dict:
    """Run the training loop (megatron_ext/training/run.py) for 1 warm-up + counted + timed
    iterations with the probe on its points.

    seams=False runs megatron-core's own code paths (our seams removed) for the side-by-side
    comparison; seams=True installs them (as a run does through the training package's hook).
    ddp_defaults=True resets the recipe's DDP keys (DDP_KEYS) to megatron's flag defaults after
    parsing (the distributed optimizer stays on)."""
    from megatron_ext.seams import registry as seam_mod
    from megatron_ext.training.run import Run

    import arguments

    iters = 1 + counted_steps + timed_steps
    argv = list(argv) + ["--train-iters", str(iters), "--log-interval", "1000000"]  # quiet stdout (--json)
    result: dict = {}
    installed_before = seam_mod.sharded_params_seams_installed()
    probe = GatherProbe()
    try:
        with probe, Run.from_argv(argv, probes=[_Measurement(probe, result, counted_steps, seams, ddp_defaults)],
                                     parse=arguments.parse) as run:
            history = run.train()
    finally:
        if installed_before:
            seam_mod.install_sharded_params_seams()
        else:
            seam_mod.remove_sharded_params_seams()

    counted = [s for s in probe.steps if s["counted"]]
    timed = [s for s in probe.steps if not s["counted"] and s["iteration"] > 1]
    c = counted[-1]
    result.update(
        rank=torch.distributed.get_rank(),
        collectives_per_step=c["sync_collectives"],
        host_ops_per_step=c["sync_ops"],
        host_syncs_per_step=c["sync_syncs"],
        sync_op_names=c["sync_op_names"],
        step_collectives=c["sync_collectives"] + c["optimizer_collectives"] + c["step_collectives"],
        optimizer_ops_per_step=c["optimizer_ops"],
        other_ops_per_step=c["step_ops"],
        host_s_per_step=min(s["sync_cpu_s"] for s in timed) if timed else c["sync_cpu_s"],
        path_wall_s_per_step=min(s["sync_s"] for s in timed) if timed else c["sync_s"],
        sync_calls_per_step=timed[-1]["sync_calls"] if timed else c["sync_calls"],
        step_s=min(s["step_s"] for s in timed) if timed else c["step_s"],
        losses=[h["lm loss"] for h in history],
    )
    return result
