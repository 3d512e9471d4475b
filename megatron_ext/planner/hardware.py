"""GPUs the planner knows: dense BF16 and FP8 peaks, HBM bandwidth, memory (as
megatron_ext.platform.target reports it) and the host link. Public datasheet figures; none measured
here (not measured on GPU). The efficiency constants are calibrated once against published runs
(``megatron_ext.planner.published``, docs/planner.md), not per case."""
from __future__ import annotations

from megatron_ext.platform.target import GPUS as _TARGETS

# name: (dense BF16 peak FLOP/s, dense FP8 peak FLOP/s, HBM bytes/s, host link bytes/s each direction)
_DATASHEET = {
    "a100": (312e12, 312e12, 2.0e12, 25e9),     # A100 SXM (no FP8: BF16 rate); PCIe Gen4 x16 (~25 GB/s)
    "h100": (989e12, 1979e12, 3.35e12, 50e9),   # H100 SXM; PCIe Gen5 x16 (~50 GB/s achieved)
    "h200": (989e12, 1979e12, 4.8e12, 50e9),    # H200 SXM; PCIe Gen5 x16
    "b200": (2250e12, 4500e12, 8.0e12, 50e9),   # B200; PCIe Gen5 x16
    "gb200": (2500e12, 5000e12, 8.0e12, 450e9),  # GB200: NVLink-C2C to the Grace CPU (900 GB/s both ways)
}
GPUS = {name: dict(memory_gib=_TARGETS[name][1], peak_flops=bf16, peak_fp8_flops=fp8, hbm=hbm, host_link=link)
        for name, (bf16, fp8, hbm, link) in _DATASHEET.items()}
# fraction of the precision's peak that the step's GEMMs reach (calibrated: docs/planner.md)
EFFICIENCY = 0.55
# bytes a MoE layer moves through HBM per routed row and hidden element, per micro-batch, forward and
# backward together, outside the GEMMs (permute / unpermute, gating, activation, their gradients):
# memory-bound work at the HBM bandwidth (calibrated: docs/planner.md)
MOE_BYTES_PER_ROW_ELEMENT = 20.0
# seconds per MoE layer and micro-batch, forward and backward together, of work that does not scale
# with the tokens (router, dispatcher host steps, kernel launches; calibrated: docs/planner.md)
MOE_LAYER_S = 0.003
