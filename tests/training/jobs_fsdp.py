"""Megatron-FSDP jobs: memory per rank under DDP + distributed optimizer and each strategy in one job
(one pool round trip), resumes, teardown and storage checks, the meta-device build. The runs that
compare the strategies' losses with DDP's: tests/training/jobs_fsdp_compose.py `variants`."""
from __future__ import annotations

import arguments

FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


MEMORY = ("param bytes", "grad bytes", "optim bytes", "fsdp unsharded bytes", "fsdp unsharded peak bytes")


def _losses(argv: list[str], probes=()) -> list[dict]:
    """Each iteration's loss and grad norm; where a log line was due, this rank's state bytes too."""
    from megatron_ext.training.run import Run

    keep = ("lm loss", "grad norm", "params norm", "num zeros", *MEMORY)
    with Run.from_argv(argv, probes, parse=arguments.parse) as run:
        history = run.train()
    return [{k: r[k] for k in keep if k in r} for r in history]


def gathers_in_flight_at_teardown(argv: list[str]) -> dict:
    """Megatron-FSDP's all-gathers not yet waited for when the run destroys its process groups."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

    from megatron_ext.training import parallel

    pipelines, in_flight = [], []
    gather, destroy = AllGatherPipeline.async_bucket_gather, parallel._destroy_subgroups

    def tracked(self, *args, **kwargs):
        if not any(p is self for p in pipelines):
            pipelines.append(self)
        return gather(self, *args, **kwargs)

    def destroying():
        in_flight.append(sum(len(p.param_gather_event_map) for p in pipelines))
        destroy()

    AllGatherPipeline.async_bucket_gather, parallel._destroy_subgroups = tracked, destroying
    try:
        _losses(argv)
    finally:
        AllGatherPipeline.async_bucket_gather, parallel._destroy_subgroups = gather, destroy
    return {"pipelines": len(pipelines), "in flight": in_flight}


RESUME_ITERS = 4  # saved at 2 and 3: a resume from 3 trains one step, the fallback to 2 one more


def resume(argv: list[str], save_dir: str, save_flags: tuple = (), fallback: bool = True,
           finetune: bool = False) -> dict:
    """4 iterations straight; 3 (saved at 2 and 3, with `save_flags`), then resumed to 4 in a fresh
    model; then the newest checkpoint damaged in the middle of a tensor and the run resumed again,
    once with --no-ckpt-fallback (refused, naming the file) and, if `fallback`, once falling back to
    iteration 2. With ``finetune``, also 2 iterations --finetune from it, and with --no-load-optim
    --no-load-rng besides."""
    import os

    import torch

    from megatron_ext.errors import ConfigError
    from megatron_ext.checkpoint.resuming import DamagedCheckpoint
    from tests.training.jobs_ckpt import _flip, _largest_tensor_item, _may_start_processes

    straight = _losses(argv + ["--train-iters", str(RESUME_ITERS)])
    with _may_start_processes():  # --async-save forks a writer per save
        first = _losses(argv + ["--train-iters", str(RESUME_ITERS), "--exit-interval", "3", "--save", save_dir,
                                "--save-interval", "2", *save_flags])
    resumed = _losses(argv + ["--train-iters", str(RESUME_ITERS), "--load", save_dir, "--auto-detect-ckpt-format"])
    # --finetune: the weights only, as megatron's (a fresh optimizer, no RNG): as if told so explicitly
    finetune = [_losses(argv + ["--train-iters", "2", "--load", save_dir, "--finetune", *no_state])
                for no_state in ((), ("--no-load-optim", "--no-load-rng"))] if finetune else None
    cross = None
    if "--use-megatron-fsdp" in argv:  # the same checkpoint into a DDP model: auto-detection reads fsdp_dtensor
        ddp = [a for a in argv if a not in FSDP and a not in ("--data-parallel-sharding-strategy", "optim_grads_params")]
        try:
            _losses(ddp + ["--use-distributed-optimizer", "--train-iters", str(RESUME_ITERS), "--load", save_dir,
                           "--auto-detect-ckpt-format"])
        except ConfigError as e:
            cross = str(e)
    newest = os.path.join(save_dir, "iter_0000003")
    files = sorted(os.listdir(newest))
    if torch.distributed.get_rank() == 0:  # bytes in the middle of a tensor: only the checksum sees it
        offset, length = _largest_tensor_item(newest, "__1_0.distcp")
        _flip(os.path.join(newest, "__1_0.distcp"), offset + length // 2)
    torch.distributed.barrier()
    try:
        _losses(argv + ["--train-iters", str(RESUME_ITERS), "--load", save_dir, "--no-ckpt-fallback"])
        refused = None
    except DamagedCheckpoint as e:
        refused = str(e)
    if fallback:
        fallback = _losses(argv + ["--train-iters", str(RESUME_ITERS), "--exit-interval", "3", "--load", save_dir])
    return {"straight": straight, "first": first, "resumed": resumed, "files": files, "refused": refused,
            "fallback": fallback, "cross": cross, "finetune": finetune}


def _geometry(model: list) -> list[dict]:
    """Megatron-FSDP's parameter groups (one per FSDP unit and dtype / expert kind, plus the
    parameters outside any unit), read from the live buffers: elements of the parameters, the
    padded (unsharded) bucket, its row length (shards are cut on rows), and its bytes per element."""
    out = []
    for chunk in model:
        for group in chunk.param_and_grad_buffer.parameter_groups:
            buf = group.main_grad_buffer
            out.append({"numel": sum(p.numel() for p in group.params), "params": len(group.params),
                        "bucket": buf.bucket_index.size,
                        "row": group.chunk_size_factor, "grad itemsize": buf.dtype.itemsize,
                        "weight itemsize": group.model_weight_buffer.dtype.itemsize})
    return out


def memory(argv: list[str], strategies: list[str]) -> dict:
    """This rank's state bytes after the last step of DDP + distributed optimizer and of each
    Megatron-FSDP strategy, the in-flight bytes of the last step, and Megatron-FSDP's bucket
    geometry (read when the log line counts the bytes, while the model is alive)."""
    from megatron_ext.training import log_line

    last = lambda history: history[-1]  # noqa: E731
    out = {"ddp": last(_losses(argv + ["--use-distributed-optimizer"]))}
    counted, geometry = log_line.state_bytes, {}

    def with_geometry(model, optimizer):
        geometry.setdefault("groups", _geometry(model))
        return counted(model, optimizer)

    log_line.state_bytes = with_geometry
    try:
        for strategy in strategies:
            geometry.clear()
            out[strategy] = last(_losses(argv + FSDP + ["--data-parallel-sharding-strategy", strategy]))
            out[strategy]["groups"] = geometry["groups"]
    finally:
        log_line.state_bytes = counted
    return out


def meta_built(argv: list[str]) -> dict:
    """The run's history, the parameters built on the meta device (before Megatron-FSDP
    materialises them), and the MoE routers' buffers once the model is built. The build runs with
    torch's deterministic fill on: memory a build leaves uninitialised reads NaN, not whatever the
    allocator held."""
    import contextlib

    import torch

    from megatron_ext.training import model as models

    from megatron.core import config

    build, meta, experimental, buffers = models._gpt_model, [], [], {}

    def recorded(*args, **kwargs):  # each chunk as GPTModel returns it, before Megatron-FSDP materialises it
        experimental.append(config.is_experimental_enabled())
        chunk = build(*args, **kwargs)
        meta.extend(n for n, p in chunk.named_parameters() if p.device.type == "meta")
        return chunk

    class Filled:  # the run's probe: the build with deterministic fill on, the routers' buffers after it
        @contextlib.contextmanager
        def around_build(self, run):
            before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
            torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty fills NaN
            try:
                yield
            finally:
                torch.use_deterministic_algorithms(before[0], warn_only=before[1])

        def after_build(self, run):
            for chunk in run.model:
                buffers.update({n: b.tolist() for n, b in chunk.named_buffers() if ".router." in n})

    models._gpt_model = recorded
    try:
        history = _losses(argv, probes=[Filled()])
    finally:
        models._gpt_model = build
    return {"history": history, "meta": meta, "experimental": experimental + [config.is_experimental_enabled()],
            "router buffers": buffers}


def storage_kept_while_in_flight(argv: list[str]) -> dict:
    """Every storage resized (freed: resize_(0), or reallocated) while an asynchronous collective that
    reads or writes it has not been waited for. gloo runs such a collective on its own threads
    until wait(); NCCL on its stream, where a block freed before the wait is handed to the next
    allocation. Whether the work happens to be done already is not asked: only the order of the
    wait and the resize, so the check does not depend on timing."""
    import contextlib
    import traceback

    import torch
    import torch.distributed as dist
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb
    from torch.distributed import distributed_c10d as c10d

    pending: dict = {}  # id(work) -> (work, storages, what)
    counts = {"async": 0, "resizes": 0}
    violations: list = []
    work_cls, storage_cls = torch._C._distributed_c10d.Work, torch.UntypedStorage
    wait, resize, coalescing = work_cls.wait, storage_cls.resize_, pgb._coalescing_manager
    wrapped = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                             "all_gather", "reduce_scatter", "broadcast", "all_to_all_single")}

    def register(work, tensors, what):
        if work is not None and type(work).__name__ != "_IllegalWork":
            counts["async"] += 1
            pending[id(work)] = (work, {t.untyped_storage()._cdata for t in tensors}, what)

    def waited(self, *args, **kwargs):
        result = wait(self, *args, **kwargs)
        pending.pop(id(self), None)
        return result

    def resized(self, nbytes):
        counts["resizes"] += 1
        for work, storages, what in pending.values():
            if self._cdata in storages:
                violations.append(f"{what}: storage of {self.nbytes()} bytes resized to {nbytes} before wait():\n"
                                  + "".join(traceback.format_stack(limit=8)[:-1]))
        return resize(self, nbytes)

    @contextlib.contextmanager
    def coalesced(group=None, device=None, async_ops=False):
        key = group or c10d._get_default_group()
        with coalescing(group, device, async_ops) as manager:
            yield manager
            ops = list(c10d._world.pg_coalesce_state.get(key, []))
        if async_ops:
            for work in manager.works:
                register(work, [t for op in ops for t in (op.tensor, op.dst_tensor) if t is not None],
                         f"coalesced {ops[0].op.__name__}")

    def tracked(name):
        def collective(*args, **kwargs):
            work = wrapped[name](*args, **kwargs)
            if kwargs.get("async_op"):
                flat = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else [a])]
                register(work, [x for x in flat if torch.is_tensor(x)], name)
            return work
        return collective

    work_cls.wait, storage_cls.resize_, pgb._coalescing_manager = waited, resized, coalesced
    for name in wrapped:
        setattr(dist, name, tracked(name))
    error = None
    try:
        _losses(argv)
    except Exception as e:  # noqa: BLE001 - a run that fails (e.g. on the garbage it gathered) still reports
        error = f"{type(e).__name__}: {e}"
    finally:
        work_cls.wait, storage_cls.resize_, pgb._coalescing_manager = wait, resize, coalescing
        for name, fn in wrapped.items():
            setattr(dist, name, fn)
    return {**counts, "unwaited": len(pending), "violations": violations, "error": error}
