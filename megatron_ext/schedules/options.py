"""The 1F1B overlap's option: one typed dataclass (config/typed.py), the one place its flag, default and
help live."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.typed import Options, option


@dataclasses.dataclass
class OverlapOptions(Options):
    PREFIX = ""  # the flag is --overlap-tp-comm-1f1b (alias --overlap-model-parallel-comm-1f1b)

    overlap_tp_comm_1f1b: bool = option(False, arg_names=["--overlap-tp-comm-1f1b",
                                                          "--overlap-model-parallel-comm-1f1b"])
    """Hide tensor-parallel communication by interleaving the backward of one micro-batch with the forward
    of another (1F1B steady phase; consecutive micro-batches without pipelining): every TP all-reduce /
    all-gather / reduce-scatter (and EP all-to-all) is issued async and waited on only after the other
    micro-batch's compute. Needs a model-parallel collective to hide: TP >= 2, or a MoE with EP >= 2
    (expert all-to-all / all-gather, any dispatcher), or expert-TP >= 2. Bit-identical loss and gradients.
    Not megatron's --tp-comm-overlap (TE userbuffers) nor --overlap-moe-expert-parallel-comm (combined
    1F1B for EP all-to-all only). Pipeline messages are sent by this schedule itself (tagged, non-blocking
    sends), so megatron's p2p options (--no-overlap-p2p-communication, batch_p2p_comm) do not apply to it."""
