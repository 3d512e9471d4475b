"""The offload vocabulary: the modules whose saved tensors can be offloaded, their aliases, and the
options one manager runs with. What the flags, the planner and the benchmarks name; no torch."""
from __future__ import annotations

import dataclasses

MODULES = ("core_attention", "qkv_linear", "router_fc1", "router_fc2", "shared_experts", "attn_proj", "moe_act")
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
class Options:
    modules: tuple
    pool_bytes: int = 1 << 30
    chunk_bytes: int = 4 << 20
    prefetch_depth: int = 1
    min_tensor_bytes: int = 64 << 10
    debug: bool = False
    # prefetch into the pass predicted to run backward next: "off"; "after-forward" (when a chunk's
    # forward returns and backward comes next); "always" (also at the end of a pass's backward)
    cross_pass_prefetch: str = "after-forward"
    # CPU copy streams deferred (run only when waited on: the latest a device could); None: as debug
    deferred_copies: bool | None = None
