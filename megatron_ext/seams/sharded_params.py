"""Seams of the sharded-parameter gather / reduce path (distributed optimizer).

megatron-core's distributed optimizer already keeps every parameter as a view into a contiguous
per-(dtype, expert/dense) buffer and communicates per bucket, coalesced:
  megatron/core/distributed/param_and_grad_buffer.py:504-521  param all-gather, one
    all_gather_into_tensor per bucket written straight into bucket.param_data (params are views
    of it: :1288-1302), inside _coalescing_manager (one c10d allgather_into_tensor_coalesced).
  param_and_grad_buffer.py:702-730  grad reduce-scatter, one per bucket, coalesced the same way.
Measured on our MoE recipes (scripts/bench_gather.py), one thing in that path is per PARAMETER:
  param_and_grad_buffer.py:301-337  _ParamAndGradBucketGroup._post_param_sync, run after every
    param all-gather (finish_param_sync :592 with overlap_param_gather; via
    distributed_data_parallel.py:516-532 _start_bucket_group_param_sync without it), scans every
    param of the bucket group with _param_uses_quantized_storage (:81), whose
    is_grouped_tensor_with_quantized_storage (megatron/core/fp8_utils.py:144-150) reads
    `param.data` (fp8_utils.py:112): one aten.detach per parameter per step, 2 per expert per layer
    with SequentialMLP, so host ops grew linearly with the number of experts.
  distributed_data_parallel.py:432-466  the forward pre-hook (overlap_param_gather) registered on
    EVERY module calls finish_param_sync once per parameter of that module, every micro-batch:
    2 calls per expert per layer per micro-batch, almost all of them no-ops after the first.
Wrapped (the DeepSpeed lessons: treat a leaf module's many small params as one unit; do no host
work per parameter once the gathered buffer is in place):
  _post_param_sync: decides once per bucket group whether it holds any quantized param (a param's
    storage class does not change after DDP has mapped it into the buffer) and, when none, returns
    without the scan. With quantized params, or reuse_grad_buf_for_mxfp8_param_ag, the original
    runs unchanged.
  DistributedDataParallel._make_forward_pre_hook (:432): the hook maps its module to the distinct
    bucket groups of its params once (cached per module), and calls finish_param_sync only for a
    group whose all-gather is not finished yet (dispatched with no handle outstanding is exactly
    the state in which upstream's call does nothing, :558-592). Same waits, same dispatch order.
    Hooks already registered are re-registered by install/remove (enable_forward_pre_hook :400).
  megatron/core/optimizer/distrib_optimizer.py:3129-3156
    DistributedOptimizer.start_param_sync_for_bucket_group_subset, the synchronous param
    all-gather after the step (without overlap_param_gather, :3158-3190): it all-gathers EVERY
    bucket group of its model chunks. An MoE model has two distributed optimizers on the same
    chunk (dense and expert, chained: optimizer.py:1635-1644), so every buffer was all-gathered
    twice per step (measured: 4 all-gathers for 2 buffers), the first time before its own
    optimizer had updated it. Wrapped: each optimizer gathers only the bucket groups whose buckets
    belong to its own buffers (self.buffers, :710); the layer-wise exclusion is kept.
"""
from __future__ import annotations

from megatron.core.distributed import distributed_data_parallel as ddp_mod
from megatron.core.distributed import param_and_grad_buffer as pgb
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.layer_wise_optimizer import _bucket_is_managed_by_layer_wise_optimizer

from megatron_ext.patching import Patch, set_attr


def _install_post_param_sync():
    orig = pgb._ParamAndGradBucketGroup.__dict__["_post_param_sync"]

    def _post_param_sync(self):
        if self.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
            return orig(self)
        quantized = self.__dict__.get("_megatron_ext_has_quantized_params")
        if quantized is None:
            quantized = any(
                pgb._param_uses_quantized_storage(p) for bucket in self.buckets for p in bucket.params_list
            )
            self._megatron_ext_has_quantized_params = quantized
        if quantized:
            return orig(self)
        return None

    return set_attr(pgb._ParamAndGradBucketGroup, "_post_param_sync", _post_param_sync)


def _install_forward_pre_hook():
    def _make_forward_pre_hook(self):
        groups_of = {}  # module -> distinct bucket groups of its params, in param order

        def hook(module, *unused):
            assert self.use_forward_hook, "Should use pre-hook only when overlap_param_gather is True"
            if ddp_mod.is_graph_capturing():
                return
            groups = groups_of.get(module)
            if groups is None:
                seen = {}
                for param in module.parameters(recurse=False):
                    group = self.param_to_bucket_group.get(param)
                    if group is not None:
                        assert param.requires_grad
                        seen.setdefault(id(group), group)
                groups = groups_of[module] = tuple(seen.values())
            if not groups:
                return
            skip_next = self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
            for group in groups:
                if group.param_gather_dispatched and group.param_gather_handle is None:
                    continue  # gathered already: upstream's finish_param_sync would do nothing
                group.finish_param_sync(skip_next_bucket_dispatch=skip_next)

        return hook

    return set_attr(ddp_mod.DistributedDataParallel, "_make_forward_pre_hook", _make_forward_pre_hook)


def _install_own_buffers_param_sync():
    orig = DistributedOptimizer.__dict__["start_param_sync_for_bucket_group_subset"]

    def start_param_sync_for_bucket_group_subset(self) -> None:
        own = {id(bucket) for buffer in getattr(self, "buffers", ()) for bucket in buffer.buckets}
        if not own:
            return orig(self)
        for model_chunk in self.model_chunks:
            for bucket_group in model_chunk.bucket_groups + model_chunk.expert_parallel_bucket_groups:
                if not bucket_group.buckets or id(bucket_group.buckets[0]) not in own:
                    continue
                if _bucket_is_managed_by_layer_wise_optimizer(bucket_group.buckets[0], default_for_untagged=False):
                    continue
                model_chunk._start_bucket_group_param_sync(bucket_group, force_sync=False)

    return set_attr(DistributedOptimizer, "start_param_sync_for_bucket_group_subset",
                    start_param_sync_for_bucket_group_subset)


POST_PARAM_SYNC = Patch(
    "sharded_params.post_param_sync",
    ["megatron/core/distributed/param_and_grad_buffer.py:301", "megatron/core/fp8_utils.py:112"],
    "one aten.detach per parameter per step: the quantized-storage scan, decided once per bucket group",
    _install_post_param_sync,
)
FORWARD_PRE_HOOK = Patch(
    "sharded_params.forward_pre_hook",
    ["megatron/core/distributed/distributed_data_parallel.py:432"],
    "finish_param_sync once per parameter per micro-batch: once per bucket group still gathering",
    _install_forward_pre_hook,
)
OWN_BUFFERS_PARAM_SYNC = Patch(
    "sharded_params.own_buffers_param_sync",
    ["megatron/core/optimizer/distrib_optimizer.py:3129"],
    "chained dense + expert distributed optimizers each all-gathered every buffer: each gathers its own",
    _install_own_buffers_param_sync,
)
SEAMS = [POST_PARAM_SYNC, FORWARD_PRE_HOOK, OWN_BUFFERS_PARAM_SYNC]


def for_run(args) -> list:
    return SEAMS


def reregister_forward_pre_hooks(model) -> None:
    """DDP chunks built before an install or remove: their forward pre-hooks made again, so they
    use the code now in place (enable_forward_pre_hook, distributed_data_parallel.py:400)."""
    for chunk in model or ():
        if getattr(chunk, "use_forward_hook", False) and chunk.remove_forward_pre_hook_handles:
            chunk.disable_forward_pre_hook(param_sync=False)
            chunk.enable_forward_pre_hook()
