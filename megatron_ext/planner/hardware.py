"""GPUs the planner knows: dense BF16 peak, memory (as megatron_ext.platform.target reports it) and
the host link. Public datasheet figures; none measured here (not measured on GPU)."""
from __future__ import annotations

from megatron_ext.platform.target import GPUS as _TARGETS

# name: (dense BF16 peak FLOP/s, host link bytes/s each direction)
_PEAK_AND_LINK = {
    "a100": (312e12, 25e9),    # A100 SXM; PCIe Gen4 x16 (~25 GB/s achieved)
    "h100": (989e12, 50e9),    # H100 SXM; PCIe Gen5 x16 (~50 GB/s achieved)
    "h200": (989e12, 50e9),    # H200 SXM; PCIe Gen5 x16
    "b200": (2250e12, 50e9),   # B200; PCIe Gen5 x16
    "gb200": (2500e12, 450e9),  # GB200: NVLink-C2C to the Grace CPU (900 GB/s both directions)
}
GPUS = {name: dict(memory_gib=_TARGETS[name][1], peak_flops=p, host_link=link)
        for name, (p, link) in _PEAK_AND_LINK.items()}
# fraction of peak the step's GEMMs reach (model FLOPs utilisation of a tuned megatron run, about 40 %)
EFFICIENCY = 0.4
