"""Seams of Megatron-FSDP's fetch / release / gradient path (optim_grads_params: ZeRO-3).

Measured per MoE layer (scripts/bench_fsdp.py, docs/fsdp.md "Fetch and release: measured"),
megatron-core 0.19.2's Megatron-FSDP already does per FSDP unit what the ZeRO-3 lessons ask of the
fetch: one coalesced all-gather per (unit, dense/expert) parameter group
(megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4559-4567, :4705), straight
into a flat bucket the parameters view (no copy after the gather), and the bucket's storage
resized to 0 after use (:139 _free_storage, StorageResizeBasedBucketAllocator :526, the default
allocator :2571). Collectives and stream/event calls per layer do not grow with the number of
experts. What does grow is host work per PARAMETER:
  param_and_grad_buffer.py:1339-1348  DataParallelBuffer.fetch_bucket(set_param_data=True), run
    on every fetch (forward and backward, AllGatherPipeline.async_bucket_gather :4702), makes
    every parameter's view of the bucket again: one aten.slice + one aten.view per parameter per
    fetch, 8 per expert per layer per step with SequentialMLP (2 weights, 2 fetches). With the
    default allocator the bucket is the same tensor every time, its storage only resized, so the
    views made at the first fetch are still views of it.
  megatron_fsdp.py:1110  a post-accumulate-grad hook on every parameter: each makes the
    parameter's view of a freshly allocated gradient bucket (param_and_grad_buffer.py:3086-3112,
    main_grad_getter: slice + view), copies the gradient into it (megatron_fsdp.py:658 _grad_acc)
    and calls reduce_gradients for that one parameter (:704-777).
  param_and_grad_buffer.py:3343-3400  update_main_grads (finish_grad_sync), every step: one shard
    view (slice + view) per parameter for the optimizer, after zero_grad dropped them (:3181).
Replaced (the lesson of the seeds: one unit per module, no per-parameter work per fetch, views
made before and kept, not made again):
  persistent_param_views  fetch_bucket: when every parameter of the buffer already views the
    fetched bucket's storage (storage identity, no tensor op), the views are not made again. Any
    other case (first fetch, a bucket tensor from another allocator, a parameter whose data was
    replaced, FP8) runs upstream's loop.
  unit_hooks  MegatronFSDP._register_fsdp_hooks (megatron_fsdp.py:513), after upstream's, for
    every FSDP unit: (a) its parameters' per-parameter gradient hooks are replaced by one
    multi-grad hook on the unit's inputs (it fires once the unit's backward is done; autograd
    runs a parameter's AccumulateGrad first once it is ready, so the unit's gradients are there).
    It copies them into their views of the gradient buckets with one foreach copy per bucket and
    calls reduce_gradients once for the unit (an unsharded gradient buffer, as with expert
    data-parallel size 1, is accumulated into in place with one foreach add, as upstream does per
    parameter, megatron_fsdp.py:662-671). The sharded gradient buckets get the storage-resizing
    allocator the weight buckets already use, so those views are made once; their storage is
    still freed after each reduce-scatter. Parameters without a gradient by then (an expert no
    token reached) are left to upstream's root post-backward callback (megatron_fsdp.py:853), as
    with upstream's hooks. (b) Its pre-forward fetch, post-forward release and post-backward
    release hooks (megatron_fsdp.py:779, :955, :682) work on its parameters, distinct buckets and
    modules listed once, releasing each bucket once instead of once per parameter
    (release_module_parameters :600), with upstream's training-state logic. Only for the plain
    configuration (optim_grads_params, no fine-grained hooks, no FP8 / DTensor parameters, no
    hybrid FSDP, no double buffer, no NaN reporting); any other keeps upstream's hooks.
  bucket_waits  all_gather_and_wait_parameters_ready (megatron_fsdp.py:458): waits once per
    bucket in first-seen order, not once per parameter (not with FP8 parameters).
  bound_main_grads  update_main_grads: from the second call, while the sharded gradient buffers are
    the same tensors and the gradients are views of them (no cast to the main weights' dtype, no
    decoupled gradient), each optimizer parameter gets back the DTensor over the view made the
    first time, with no tensor op.
Same values bit for bit, the same collectives; a unit's reduce-scatters are issued together, in
bucket order, once its backward is done (tests/seams/test_fsdp_fetch.py).
"""
from __future__ import annotations

import functools

import torch

from megatron_ext.patching import Patch, set_attr


def _install_persistent_param_views():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    cls = pgb.DataParallelBuffer
    original = cls.fetch_bucket

    def fetch_bucket(self, dtype=None, set_param_data=False, strict_assignments=True):
        if not set_param_data:
            return original(self, dtype=dtype, set_param_data=False, strict_assignments=strict_assignments)
        bucket = original(self, dtype=dtype, set_param_data=False, strict_assignments=strict_assignments)
        storage = bucket.data.untyped_storage()._cdata
        if all(
            not pgb.is_float8tensor(p) and pgb.to_local_if_dtensor(p).untyped_storage()._cdata == storage
            for p in self.params
        ):
            return bucket  # the views made at an earlier fetch are views of this bucket
        # Upstream's loop (param_and_grad_buffer.py:1339-1348).
        for p in self.params:
            item_id = self.param_idx[p]
            p = pgb.to_local_if_dtensor(p)
            data = self.get_item_from_bucket(bucket, item_id).view(p.shape)
            if pgb.is_float8tensor(p):
                pgb.fp8_set_raw_data(p, data, self.is_transpose_buffer)
            else:
                p.data = data
        return bucket

    fetch_bucket.__wrapped__ = original
    return set_attr(cls, "fetch_bucket", fetch_bucket)


def _unit_gradient_handler(fsdp, unit_params):
    """After a unit's backward: its gradients copied into their (persistent) views of the gradient
    buckets with one foreach copy per bucket, and one reduce_gradients call for the unit. What
    upstream's per-parameter hook does (megatron_fsdp.py:633-666 _grad_acc, :704-777
    _process_post_backward_gradients), for the parameters whose gradient is there; the others are
    left to upstream's root post-backward callback (megatron_fsdp.py:853), as before."""
    # Everything is looked up through `fsdp` at call time: a hook the autograd graph still holds
    # after the run must not keep the buffers (and through them the process groups) alive.

    def handler():
        buffer = fsdp.param_and_grad_buffer
        cache = fsdp._ext_main_grad_views  # param -> (bucket tensor, view)
        pending = fsdp._params_require_handle_grad
        by_bucket: dict = {}
        for p in unit_params:
            if p.grad is None or p.grad_added_to_main_grad or p not in pending:
                continue
            by_bucket.setdefault(buffer.param_to_param_group[p], []).append(p)
        done = []
        for bucket_id, params in sorted(by_bucket.items()):
            gbuf = buffer.parameter_groups[bucket_id].main_grad_buffer
            sharded = gbuf.is_data_distributed
            # Sharded: a temporary unsharded bucket the gradients are copied into (reduce-scattered
            # next). Unsharded (e.g. expert data-parallel size 1): the persistent buffer itself,
            # gradients accumulated into it (megatron_fsdp.py:662-671).
            bucket = gbuf.fetch_bucket(dtype=buffer.mp_policy.grad_comm_dtype) if sharded else None
            key = bucket.data if sharded else gbuf.data
            views = []
            for p in params:
                hit = cache.get(p)
                if hit is None or hit[0] is not key:
                    view = gbuf.get_item_from_bucket(bucket, p._item_id) if sharded else p.get_main_grad()
                    hit = cache[p] = (key, view.view(p.shape))
                views.append(hit[1])
            grads = [p.grad for p in params]
            if any(v.dtype != g.dtype for v, g in zip(views, grads)):  # casts: upstream's per-tensor ops
                for v, g in zip(views, grads):
                    v.copy_(g) if sharded else v.add_(g)
            elif sharded:
                torch._foreach_copy_(views, grads)
            else:
                torch._foreach_add_(views, grads)
            for p, view in zip(params, views):
                p.main_grad = view
                p.grad = None
                p.grad_added_to_main_grad = False
            done.extend(params)
        if done:
            fsdp.grad_reduce_pipeline.reduce_gradients(
                done, suggested_queue_capacity=fsdp.suggested_RS_queue_capacity, outer_fsdp_group_grad_reduce=False
            )
            pending.difference_update(done)

    return handler


def _unit_hooks_apply(fsdp, root_module) -> bool:
    """Per-unit instead of per-parameter gradient handling on one MegatronFSDP, where the
    configuration is the plain one this is written for; False (upstream's hooks kept) otherwise."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    buffer = fsdp.param_and_grad_buffer
    if (
        fsdp.data_parallel_sharding_strategy != "optim_grads_params"
        or fsdp.enable_fine_grained_param_gather_hook
        or fsdp.report_nan_in_param_grad
        or fsdp.dist_index.use_hybrid_fsdp
        or fsdp.ddp_config.fsdp_double_buffer
        or any(pgb.is_float8tensor(p) or isinstance(p, torch.distributed.tensor.DTensor)
               for p in root_module.parameters())
    ):
        return False
    groups = buffer.parameter_groups
    for group in groups:
        if group.main_grad_buffer is None or group.hfsdp_helper_gbuf is not None:
            return False
    units = [m for m in root_module.modules() if isinstance(m, tuple(fsdp.fsdp_unit_modules))]
    top = [u for u in units if not any(u is not o and any(u is m for m in o.modules()) for o in units)]
    fsdp._ext_main_grad_views = {}
    # The gradient buckets keep one tensor whose storage is resized (as the weight buckets do,
    # param_and_grad_buffer.py:526), so the per-parameter views of it are made once.
    for group in groups:
        alloc = group.main_grad_buffer.temporary_bucket_allocator
        if group.main_grad_buffer.is_data_distributed and type(alloc) is pgb.TemporaryBucketAllocator \
                and not alloc.buckets:
            group.main_grad_buffer.temporary_bucket_allocator = pgb.StorageResizeBasedBucketAllocator()
    name_of = fsdp.param_to_name
    fsdp._ext_units_released_per_bucket = 0
    for unit in top:
        params = [p for p in unit.parameters() if p.requires_grad]
        if not _unit_fetch_release(fsdp, unit, _unit_gradient_handler(fsdp, params)):
            continue  # upstream's hooks for this unit
        fsdp._ext_units_released_per_bucket += 1
        for p in params:  # upstream's per-parameter hook (megatron_fsdp.py:1110)
            handle = fsdp.grad_acc_hooks.pop(f"grad_acc and reduce for {name_of[p]}", None)
            if handle is not None:
                handle.remove()
    return True


def _hook_id(hooks: dict, name: str):
    """The id of the one hook in a module's hook dict whose function (or partial's function) is
    upstream's `name`; None when there is not exactly one."""
    found = [k for k, fn in hooks.items() if getattr(getattr(fn, "func", fn), "__name__", None) == name]
    return found[0] if len(found) == 1 else None


def _unit_fetch_release(fsdp, unit, gradients) -> bool:
    """The unit's fetch and release hooks made per bucket: upstream's (megatron_fsdp.py:779
    _pre_forward_param_unshard, :955 _post_forward, :682 _post_backward_release_module via :801)
    list the unit's parameters by walking its modules on every call and release per parameter
    (:600 release_module_parameters, the same bucket once per parameter). Here the unit's
    parameters, its distinct buckets (in upstream's order) and its modules are listed once, at
    wrap time, and each bucket is released once. Replaced in place in the module's hook dicts, so
    the hooks keep their order."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp import TrainingState
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import PrefetchOrder

    pre_id = _hook_id(unit._forward_pre_hooks, "_pre_forward_param_unshard")
    post_id = _hook_id(unit._forward_hooks, "_post_forward")
    bwd_id = _hook_id(unit._forward_pre_hooks, "_register_post_backward_hook")
    if None in (pre_id, post_id, bwd_id):
        return False
    params = list(unit.parameters())
    buckets = list(dict.fromkeys(fsdp.param_and_grad_buffer.param_to_param_group[p] for p in params))
    modules = list(unit.modules())

    def pre_forward(module, *unused):
        prefetch = True
        if module._training_state == TrainingState.PRE_BACKWARD:
            prefetch = False  # recompute inside the backward: no forward prefetch
        else:
            module._training_state = TrainingState.FORWARD
        fsdp.all_gather_and_wait_parameters_ready(
            params=params, prefetch=prefetch, prefetch_order=PrefetchOrder.FORWARD_PASS_ORDER
        )

    def post_forward(module, inputs, output):
        lazy = module._training_state == TrainingState.PRE_BACKWARD
        if not lazy:
            module._training_state = TrainingState.IDLE
        for bucket_id in buckets:
            fsdp.all_gather_pipeline.release_bucket(bucket_id, False, lazy=lazy)
        return output

    def post_backward(module, *unused):
        gradients()
        for bwd in (True, False):
            for bucket_id in buckets:
                fsdp.all_gather_pipeline.release_bucket(bucket_id, bwd)
        for m in modules:
            m._training_state = TrainingState.IDLE

    unit._forward_pre_hooks[pre_id] = pre_forward
    unit._forward_hooks[post_id] = post_forward
    unit._forward_pre_hooks[bwd_id] = functools.partial(unit._forward_pre_hooks[bwd_id].func, post_backward)
    return True


def _install_unit_hooks():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    cls = megatron_fsdp.MegatronFSDP
    original = cls._register_fsdp_hooks

    def _register_fsdp_hooks(self, root_module):
        original(self, root_module)
        self._ext_fp8 = any(pgb.is_float8tensor(p) for p in root_module.parameters())
        self._ext_unit_hooks = _unit_hooks_apply(self, root_module)

    _register_fsdp_hooks.__wrapped__ = original
    return set_attr(cls, "_register_fsdp_hooks", _register_fsdp_hooks)


def _install_bound_main_grads():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as pgb

    cls = pgb.ParamAndGradBuffer
    original = cls.update_main_grads

    def update_main_grads(self):
        bound = getattr(self, "_ext_bound_main_grads", None)
        named = self.optimizer_named_parameters
        if (
            bound is not None
            and all(g.main_grad_buffer.data is d for g, d in bound[0])
            # the same optimizer parameters and gradient DTensors (a checkpoint load may replace them)
            and len(named) == len(bound[1])
            and all(p is e[0] and self.dist_main_grad.get(n) is e[3] for (n, p), e in zip(named, bound[1]))
        ):
            # Upstream's result again, without making the views again: each optimizer
            # parameter's gradient is the DTensor over its view of the sharded gradient buffer.
            for param, dist_grad, local, _ in bound[1]:
                if dist_grad is not None:
                    dist_grad._local_tensor = local
                param.grad = dist_grad
            return
        original(self)
        self._ext_bound_main_grads = None
        # Bound only where upstream's gradient is a view of the persistent sharded gradient
        # buffer: no cast to the main weights' dtype, no decoupled gradient.
        if self.use_decoupled_grad or any(
            g.main_grad_buffer is not None and g.main_weight_buffer is not None
            and g.main_grad_buffer.data.dtype != g.main_weight_buffer.data.dtype
            for g in self.parameter_groups
        ):
            return
        entries = []
        for name, param in self.optimizer_named_parameters:
            dist_grad = self.dist_main_grad.get(name)
            if param.grad is not dist_grad and param.grad is not None:
                return
            grad = param.grad
            entries.append((param, grad, None if grad is None else grad._local_tensor, dist_grad))
        self._ext_bound_main_grads = (
            [(g, g.main_grad_buffer.data) for g in self.parameter_groups if g.main_grad_buffer is not None],
            entries,
        )

    update_main_grads.__wrapped__ = original
    return set_attr(cls, "update_main_grads", update_main_grads)


def _install_bucket_waits():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    cls = megatron_fsdp.MegatronFSDP
    original = cls.all_gather_and_wait_parameters_ready

    def all_gather_and_wait_parameters_ready(self, params, prefetch=True, prefetch_order=None, wait_bucket_ready=True,
                                             bwd=False):
        if prefetch_order is None:
            prefetch_order = megatron_fsdp.PrefetchOrder.FORWARD_PASS_ORDER
        # FP8 parameters get a transpose cache made after each wait (upstream :494): not here.
        if not wait_bucket_ready or self.data_parallel_sharding_strategy == "no_shard" or getattr(
            self, "_ext_fp8", True
        ):
            return original(self, params, prefetch, prefetch_order, wait_bucket_ready, bwd)
        # Upstream (megatron_fsdp.py:458-511) waits once per parameter; the same buckets once
        # each, in the same (first-seen) order.
        original(self, params, prefetch, prefetch_order, wait_bucket_ready=False, bwd=bwd)
        to_group = self.param_and_grad_buffer.param_to_param_group
        for bucket_id in dict.fromkeys(to_group[p] for p in params):
            self.all_gather_pipeline.wait_bucket_ready(bucket_id, bwd)

    all_gather_and_wait_parameters_ready.__wrapped__ = original
    return set_attr(cls, "all_gather_and_wait_parameters_ready", all_gather_and_wait_parameters_ready)


PERSISTENT_PARAM_VIEWS = Patch(
    "fsdp_fetch.persistent_param_views",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:1291"],
    "every fetch made every parameter's view of the unsharded bucket again (2 ops per parameter): "
    "made once, while the bucket is the same storage",
    _install_persistent_param_views,
)
UNIT_HOOKS = Patch(
    "fsdp_fetch.unit_hooks",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:513",
     "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:1110",
     "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:600"],
    "a post-accumulate-grad hook per parameter (a view of the gradient bucket, a copy, a "
    "reduce_gradients call each) and a release per parameter: per FSDP unit, per bucket",
    _install_unit_hooks,
)
BUCKET_WAITS = Patch(
    "fsdp_fetch.bucket_waits",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:458"],
    "a wait for the gathered bucket once per parameter: once per bucket",
    _install_bucket_waits,
)
BOUND_MAIN_GRADS = Patch(
    "fsdp_fetch.bound_main_grads",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:3343"],
    "finish_grad_sync made every optimizer parameter's view of its gradient shard again each step "
    "(2 ops per parameter): kept while the sharded gradient buffer is the same tensor",
    _install_bound_main_grads,
)
SEAMS = [PERSISTENT_PARAM_VIEWS, UNIT_HOOKS, BUCKET_WAITS, BOUND_MAIN_GRADS]


def for_run(args) -> list:
    return SEAMS if args.use_megatron_fsdp else []


def applied():
    """The seams active inside the block (benchmarks, tests); install before the wrapper is built."""
    import contextlib

    stack = contextlib.ExitStack()
    for record in SEAMS:
        stack.enter_context(record.applied())
    return stack


def removed():
    """megatron-core's own code inside the block (side-by-side measurements, tests)."""
    import contextlib

    stack = contextlib.ExitStack()
    for record in SEAMS:
        stack.enter_context(record.without())
    return stack
