"""Seams of Megatron-FSDP's parameter fetch (optim_grads_params: ZeRO-3).

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
Replaced (the lesson of the seeds: one unit per module, no per-parameter work per fetch):
  fetch_bucket: when every parameter of the buffer already views the fetched bucket's storage
    (checked by identity of the storage, no tensor op), the views are not made again. Any other
    case (first fetch, a new bucket tensor from another allocator, a parameter whose data was
    replaced, FP8 parameters) runs upstream's loop unchanged.
Not replaced (measured, still per parameter; docs/fsdp.md): the gradient side, where every
parameter's post-accumulate-grad hook copies its gradient into a view of a fresh gradient bucket
(megatron_fsdp.py:658, param_and_grad_buffer.py:3090-3112) and finish_grad_sync makes one shard
view per parameter for the optimizer (param_and_grad_buffer.py:3366).
"""
from __future__ import annotations

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


PERSISTENT_PARAM_VIEWS = Patch(
    "fsdp_fetch.persistent_param_views",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:1291"],
    "every fetch made every parameter's view of the unsharded bucket again (2 ops per parameter): "
    "made once, while the bucket is the same storage",
    _install_persistent_param_views,
)
SEAMS = [PERSISTENT_PARAM_VIEWS]


def for_run(args) -> list:
    return SEAMS if getattr(args, "use_megatron_fsdp", False) else []


def applied():
    """The seams active inside the block (benchmarks, tests)."""
    import contextlib

    stack = contextlib.ExitStack()
    for record in SEAMS:
        stack.enter_context(record.applied())
    return stack
