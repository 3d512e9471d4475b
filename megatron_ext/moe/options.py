"""The MoE dispatchers' and dropless layer's options: one typed dataclass (config/typed.py), the one place
their flags, defaults, ranges and help live."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, option


@dataclasses.dataclass
class MoEOptions(Options):
    PREFIX = "moe_"  # --moe-<field>

    sync_free_dispatcher: bool = False
    """Replace the token dispatcher of every MoE layer by megatron_ext's sync-free multihot dispatcher. It
    keeps the communication chosen by --moe-token-dispatcher-type (alltoall or allgather) and gives the
    same outputs; with --moe-expert-capacity-factor the MoE layer runs with no host-device synchronisation
    (CUDA-graph capturable), in dropless mode with exactly one (the variable split sizes). See docs/moe.md."""

    zero_sync_dropless: bool = False
    """With --moe-sync-free-dispatcher in dropless mode: no host synchronisation at all. Tokens travel in
    fixed-size per-rank buffers (a token budget), the experts run as grouped GEMMs over per-expert offsets
    kept on the device (local spec experts). Bit-identical to megatron's dropless dispatcher while nothing
    overflows the budget."""

    dropless_budget_factor: float | None = option(None, Domain(float, 0, lo_open=True), "positive")
    """With --moe-zero-sync-dropless: rows of each buffer as a multiple of the balanced load (tokens x
    top-k / EP), capped at the worst case. Default: the worst case (tokens x min(top-k, local experts)),
    where nothing can overflow."""

    dropless_overflow: str = option("error", choices=("error", "drop"))
    """With --moe-zero-sync-dropless and a budget below the worst case: what a routing that overflows it
    does. error: stop at the next log line, naming the factor that would have fitted; drop: drop the pairs
    past the budget, counted in the log line. (default: error)"""

    @property
    def zero_sync(self) -> bool:
        """The zero-sync dropless layer runs (its flag with the sync-free dispatcher's)."""
        return self.sync_free_dispatcher and self.zero_sync_dropless
