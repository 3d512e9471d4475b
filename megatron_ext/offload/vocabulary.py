"""The offload vocabulary: the modules whose saved tensors can be offloaded, their aliases, and
``OffloadOptions``, the one declaration of offload's flags (their types, defaults, ranges and help,
config/typed.py): what the flags, the manager, the planner and the benchmarks name; no torch."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, option

MODULES = ("core_attention", "qkv_linear", "router_fc1", "router_fc2", "shared_experts", "attn_proj", "moe_act",
           "dense_mlp")
ALIASES = {"core_attn": "core_attention", "expert_fc1": "router_fc1"}


def canonical_modules(names) -> tuple:
    out = []
    for n in names:
        n = ALIASES.get(n, n)
        if n not in MODULES:
            raise ValueError(n)
        if n not in out:
            out.append(n)
    return tuple(out)


@dataclasses.dataclass
class OffloadOptions(Options):
    """chunked, race-free activation offload (docs/offload.md)"""

    PREFIX = "activation_offload_"

    modules: list[str] | None = option(None, metavar="MODULE")
    """Offload to host memory what these modules save for backward, and bring it back before backward
    needs it. Any of: core_attention, qkv_linear, router_fc1, router_fc2, shared_experts, attn_proj,
    moe_act, dense_mlp (a dense layer's MLP) (aliases: core_attn=core_attention, expert_fc1=router_fc1).
    Not given: offload is off."""

    pool_mb: float = option(1024.0, Domain(float, 0, lo_open=True), "a scale, factor, size or duration")
    """Size of the host pool (pinned on CUDA) that offloaded bytes live in. When it is full a tensor
    stays on the device."""

    chunk_mb: float = option(4.0, Domain(float, 0, lo_open=True), "a scale, factor, size or duration")
    """Copies move in chunks of this size (one pool slot each)."""

    prefetch_depth: int = option(1, Domain(int, 0), "a count where 0 means none (or off), or an index")
    """In backward, reload this many layers ahead of the one being computed."""

    cross_pass_prefetch: str = option("after-forward", choices=("off", "after-forward", "always"))
    """Also prefetch the last layers of the micro-batch predicted (from the previous step's observed
    order) to run backward next: after-forward = when a chunk's forward returns and a backward comes
    next (overlaps the pipeline wait; no extra peak measured); always = also at the end of a
    micro-batch's backward when another backward follows (one more layer resident at non-last
    stages' peak)."""

    min_tensor_kb: float = option(64.0, Domain(float, 0), "a rate, coefficient or amount where 0 means none")
    """Saved tensors (storages) smaller than this stay on the device."""

    debug: bool = False
    """Poison released device storage, free pool slots and unfilled reload buffers with NaN bytes
    (released storage is also resized to 0); on CPU run the copy streams as deferred queues, so a
    missing wait or early release fails loudly."""

    @property
    def pool_bytes(self) -> int:
        return int(self.pool_mb * (1 << 20))

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * (1 << 20)))

    @property
    def min_tensor_bytes(self) -> int:
        return int(self.min_tensor_kb * 1024)
