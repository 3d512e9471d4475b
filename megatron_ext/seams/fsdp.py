"""Seams of Megatron-FSDP (--use-megatron-fsdp).

Its fsdp_dtensor checkpoints are written by megatron-core's writer (checkpoint/fsdp.py),
whose writes checkpointing.CHECKSUMMED_WRITES sums, and read through torch's
FileSystemReader.read_data, which checkpointing.VERIFIED_READS wraps. Reached into
(complete_fsdp_optimizer_state): the torch optimizer's per-parameter state, so that every rank
names the same optimizer keys; and (wait_for_prefetched_gathers) the all-gather pipeline's in-flight
buckets, waited for at the end of a run; (KeptBuffers) the module buffers its meta-device
initialisation empties, put back. Counted (UNSHARDED_BYTES, for the log line's memory): the
temporary buckets Megatron-FSDP allocates for the unsharded parameters and gradients of the layers
in flight (param_and_grad_buffer.py:501-559, the allocators used without --fsdp-double-buffer).
"""
from __future__ import annotations

import torch
from megatron.core.utils import to_local_if_dtensor

from megatron_ext.patching import Patch, set_attr


class InFlight:
    """Bytes of Megatron-FSDP's temporary (unsharded) buckets alive now, and the peak since reset."""

    live: dict = {}  # (allocator, bucket id) -> bytes its storage holds
    now = 0
    peak = 0

    @classmethod
    def reset_peak(cls) -> None:
        cls.peak = cls.now

    @classmethod
    def update(cls, allocator, bucket_id) -> None:
        bucket = allocator.buckets.get(bucket_id)
        held = bucket.data.untyped_storage().nbytes() if bucket is not None else 0
        cls.now += held - cls.live.get((id(allocator), bucket_id), 0)
        cls.live[(id(allocator), bucket_id)] = held
        cls.peak = max(cls.peak, cls.now)


def _install_unsharded_bytes():
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffers

    undo = []
    # the default allocator, and the one that keeps a bucket and resizes its storage (weights)
    for cls in (buffers.TemporaryBucketAllocator, buffers.StorageResizeBasedBucketAllocator):
        allocate, free = cls.__dict__["allocate"], cls.__dict__["free"]

        def counted_allocate(self, bucket_id, *args, _allocate=allocate, **kwargs):
            bucket = _allocate(self, bucket_id, *args, **kwargs)
            InFlight.update(self, bucket_id)
            return bucket

        def counted_free(self, bucket_id, _free=free):
            result = _free(self, bucket_id)
            InFlight.update(self, bucket_id)
            return result

        undo += [set_attr(cls, "allocate", counted_allocate), set_attr(cls, "free", counted_free)]

    def remove():
        for u in reversed(undo):
            u()
        InFlight.live, InFlight.now, InFlight.peak = {}, 0, 0

    return remove


UNSHARDED_BYTES = Patch(
    "fsdp.unsharded_bytes",
    ["megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:501",
     "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:517",
     "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:535",
     "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:553"],
    "Megatron-FSDP gathers a layer's parameters (and collects its unsharded gradients) into temporary "
    "buckets: counted as they are allocated and freed, for the per-rank memory in the log line",
    _install_unsharded_bytes,
)
SEAMS = [UNSHARDED_BYTES]


def for_run(args):
    return [UNSHARDED_BYTES] if args.use_megatron_fsdp else []


def wait_for_prefetched_gathers(chunk) -> None:
    """Wait for the all-gathers a Megatron-FSDP wrapper still has in flight, issuing none.

    With --overlap-param-gather the end of every step prefetches the next forward's buckets (one
    async all-gather each, param_and_grad_buffer.py:4682-4725); after a run's last step nothing
    waits for them, and process groups destroyed under them crashed the process now and then (a
    segfault in gloo, measured). The wrapper's own stop_communication would also reduce-scatter the
    gradients again without --overlap-grad-reduce, a new collective at teardown, and its pipeline
    reset warns about exactly these pending gathers."""
    pipeline = getattr(getattr(chunk, "module", None), "all_gather_pipeline", None)
    if pipeline is None:
        return
    for bucket_id, bwd in list(pipeline.param_gather_event_map):
        pipeline.wait_bucket_ready(bucket_id, bwd)


class KeptBuffers:
    """The buffers Megatron-FSDP's meta-device initialisation empties, kept and put back.

    With --init-model-with-meta-device, Megatron-FSDP materialises every module that owns a meta
    parameter with `m.to_empty(device, recurse=False)` and then calls its reset_parameters
    (param_and_grad_buffer.py:2902-2914). to_empty gives the module's buffers new, uninitialised
    storage too, while the buffers were built with their values (a buffer made with an explicit
    device is not meta); reset_parameters re-initialises only the parameters. The MoE router's
    `expert_bias` and `local_tokens_per_expert` (moe/router.py:179-195, built as zeros; its
    reset_parameters, router.py:75, draws only the weight) were left as whatever memory they got:
    the first step routed tokens with a bias that differed from process to process and rank to rank
    (measured: iteration 1's loss of recipes/deepseek_v3_fsdp_tiny.yaml 5.77166 and 5.77187 in two
    fresh runs). A GPU's uninitialised memory is no more defined than a CPU's.

    `KeptBuffers(chunks)` before the wrap copies each such module's own non-meta buffers;
    `restore()` after it writes the values back into whatever tensor the module holds then."""

    def __init__(self, chunks) -> None:
        self.kept = []  # (module, buffer name, value at build)
        for chunk in chunks:
            for module in chunk.modules():
                if not any(p.is_meta for p in module.parameters(recurse=False)):
                    continue
                for name, buf in module.named_buffers(recurse=False):
                    if buf is not None and not buf.is_meta:
                        self.kept.append((module, name, buf.detach().clone()))

    @torch.no_grad()
    def restore(self) -> int:
        """Put every kept value back; the number of buffers restored."""
        for module, name, value in self.kept:
            module._buffers[name].copy_(value)
        n, self.kept = len(self.kept), []
        return n


def complete_fsdp_optimizer_state(optimizer) -> None:
    """Give every parameter whose shard on this rank is empty an (empty) Adam state.

    Megatron-FSDP shards flat buckets, so a small parameter (a norm's weight) can lie wholly on
    another rank: here its shard is empty, its gradient None (param_and_grad_buffer.py:3393), and
    the optimizer never creates its state (nor does the dummy step before a load,
    distrib_optimizer.py:1430). The fsdp_dtensor state dict then names different optimizer keys on
    different ranks (distrib_optimizer.py:1650), while megatron's preprocessing runs a collective per
    DTensor key (uneven_dtensor.py:247-253, validate_uneven_dtensor): the ranks issue different
    collectives and the save hangs. An empty state changes no update: such a parameter never has a
    gradient here, so the optimizer skips it. Its `step` is kept equal to the others' at every save:
    measured, a stale one (from an earlier save) made the iterations after a resume differ."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        empty = [p for p in params if to_local_if_dtensor(p).numel() == 0]
        skip = {id(p) for p in empty}  # by identity: `in` would compare (D)Tensors elementwise
        steps = [inner.state[p]["step"] for p in params if id(p) not in skip and "step" in inner.state.get(p, {})]
        step = steps[0] if steps else torch.tensor(0.0)
        for p in empty:  # the step kept current too: a load takes the step from the saved states
            state = inner.state[p]
            state.setdefault("exp_avg", torch.zeros_like(p))
            state.setdefault("exp_avg_sq", torch.zeros_like(p))
            state["step"] = step.clone()
