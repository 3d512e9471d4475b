"""GPUs the planner knows, and the datasheet model of their kernels.

Per GPU: dense BF16 and FP8 peaks, HBM bandwidth, host link, streaming multiprocessors (public
datasheet figures; memory as megatron_ext.platform.target reports it). A GPU whose measured profile
is stored (``megatron_ext.planner.profiles``) has its kernels timed from it; what the profile does not
hold, and every GPU without one, is timed by the datasheet model below (``profiles.Device``):

- a matrix product: the larger of its FLOPs at the precision's peak x ``GEMM_EFFICIENCY`` x the share
  of the last wave of output tiles the SMs fill, and its bytes (operands read, output written; a weight
  gradient accumulated into the main gradient reads and writes it) at the HBM bandwidth x
  ``HBM_EFFICIENCY``: small-M products are bandwidth-bound;
- a grouped product (the experts): the same over all groups at once, each expert's weights read once;
- flash-class attention (torch SDPA, transformer-engine's fused): its FLOPs (the causal or windowed
  pairs it computes, backward 2.5 forwards) at the BF16 peak x ``ATTENTION_EFFICIENCY``;
- megatron's unfused attention: ``UNFUSED_BYTES_PER_SCORE`` per element of the s x s scores at the
  HBM rate, beside its two batched products;
- element-wise work (norms, RoPE, activations, permutation, loss): its bytes at the HBM rate.

Where each constant comes from (docs/planner.md, "Step time"):
- ``GEMM_EFFICIENCY`` and ``MOE_LAYER_S``: chosen by ``published.fit`` over the calibration half of
  ``published.data_points`` (published H100 runs and the H200 record's whole training steps; the
  held-out half is not read by the fit);
- ``ATTENTION_EFFICIENCY``: torch SDPA's causal forward + backward measured on an H200 (2026-11-28:
  1.14 ms for 32 heads x 128 at 4096 tokens, 422 TFLOP/s counting the causal half) over the BF16 peak,
  which the H100 SXM shares; not measured on any other GPU;
- ``UNFUSED_BYTES_PER_SCORE``: counted from the tensors megatron's unfused attention reads and writes
  (``tests/planner/test_steptime.py`` counts them again);
- ``HBM_EFFICIENCY``: a typical share of the datasheet bandwidth that streaming kernels reach (not
  measured here).
"""
from __future__ import annotations

from megatron_ext.platform.target import GPUS as _TARGETS

# name: (dense BF16 peak FLOP/s, dense FP8 peak FLOP/s, HBM bytes/s, host link bytes/s each direction, SMs)
_DATASHEET = {
    "a100": (312e12, 312e12, 2.0e12, 25e9, 108),     # A100 SXM (no FP8: BF16 rate); PCIe Gen4 x16 (~25 GB/s)
    "h100": (989e12, 1979e12, 3.35e12, 50e9, 132),   # H100 SXM; PCIe Gen5 x16 (~50 GB/s achieved)
    "h200": (989e12, 1979e12, 4.8e12, 50e9, 132),    # H200 SXM; PCIe Gen5 x16
    "b200": (2250e12, 4500e12, 8.0e12, 50e9, 148),   # B200; PCIe Gen5 x16
    "gb200": (2500e12, 5000e12, 8.0e12, 450e9, 148),  # GB200: NVLink-C2C to the Grace CPU (900 GB/s both ways)
}
GPUS = {name: dict(memory_gib=_TARGETS[name][1], peak_flops=bf16, peak_fp8_flops=fp8, hbm=hbm, host_link=link,
                   sms=sms)
        for name, (bf16, fp8, hbm, link, sms) in _DATASHEET.items()}

# fraction of the precision's peak a matrix product that fills its waves reaches (fitted: published.fit)
GEMM_EFFICIENCY = 0.59
# seconds per MoE layer and micro-batch, forward and backward together, that do not scale with the
# tokens: the dispatcher's host synchronisation, after which the host launches the layer's many small
# kernels while the device waits (fitted: published.fit)
MOE_LAYER_S = 0.0045
# flash-class attention's forward + backward rate as a fraction of the BF16 peak (H200 measurement)
ATTENTION_EFFICIENCY = 0.427
# bytes read and written per element of the [b, heads, s, s] scores by megatron's unfused attention,
# forward and backward (baddbmm output, the fp32 cast, mask, softmax, the bf16 probabilities, their
# gradients through the same ops, the two bmm reads)
UNFUSED_BYTES_PER_SCORE = 82.0
# share of the datasheet HBM bandwidth streaming kernels reach
HBM_EFFICIENCY = 0.8
# the output tile of one SM's matrix-product block (rows, columns): the wave quantisation's unit
TILE = (128, 256)
