"""Hardware profiles: kernel rates measured on a GPU kind, stored here as ``<gpu>.json``, and the
``Device`` the planner's step time asks for kernel times.

A profile is what ``scripts/gpu_check_sections/kernel_profile.py`` measured on one device (or, for
the H200, what the first device run measured: each block names its source). Schema 1:

    {"schema": 1, "gpu": "h200", "device": "NVIDIA H200", "date": "YYYY-MM-DD", "torch": ..., "cuda": ...,
     "source": "what produced it",
     "gemm":         {"source", "rows": [{"dtype": "bfloat16"|"float8", "m", "n", "k", "ms"}]},
     "grouped_gemm": {"source", "rows": [{"dtype", "groups", "m", "n", "k", "ms"}]},   # m: rows per group
     "attention":    {"source", "rows": [{"kind": "unfused"|"sdpa"|"transformer_engine"|"flex",
                                          "batch", "seq", "heads", "head_dim", "causal", "fwd_bwd_ms",
                                          "documents" (optional: a document mask of that many)}]},
     "hbm":          {"source", "bytes_per_s"},
     "host_link":    {"source", "d2h_bytes_per_s", "h2d_bytes_per_s"},
     "layers":       {"source", "rows": [...]}}                # measured steps, for checking the model

Every block is optional: a kernel class the profile lacks is timed by the datasheet model
(``megatron_ext.planner.hardware``), and ``Device.sources`` says which one each class used.

Measured rates are used at other shapes as follows: a matrix product's TFLOP/s interpolated in log
space over the measured (m, n, k) grid (clamped at its edges; beyond, its bytes at the measured HBM
rate still bound it); flash-class attention's TFLOP/s (causal or windowed pairs counted) at the nearest
measured sequence length; megatron's unfused attention, bound by its s x s traffic, its measured time
per score element (batch x heads x s^2).
"""
from __future__ import annotations

import json
import math
import os

SCHEMA = 1
DIR = os.path.dirname(os.path.abspath(__file__))
FLASH_KINDS = ("sdpa", "transformer_engine", "flex")
ATTENTION_KINDS = ("unfused", *FLASH_KINDS)
# backward of flash-class attention: 2.5 forwards (the recomputed scores and four products against two)
FLASH_BACKWARD_OVER_FORWARD = 2.5
# share of the unfused attention's forward + backward traffic in its forward (counted, as
# hardware.UNFUSED_BYTES_PER_SCORE: 41.8 of 82.0 bytes per score element)
UNFUSED_FORWARD_SHARE = 0.51


def path(gpu: str) -> str:
    return os.path.join(DIR, f"{gpu}.json")


def known() -> list:
    return sorted(f[:-5] for f in os.listdir(DIR) if f.endswith(".json"))


def load(gpu: str) -> dict | None:
    """The stored profile of ``gpu``, or None."""
    p = path(gpu)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        profile = json.load(f)
    check(profile)
    return profile


def check(profile: dict) -> None:
    """Raises ValueError naming what a profile lacks."""
    if profile.get("schema") != SCHEMA:
        raise ValueError(f"hardware profile: schema {profile.get('schema')!r}, expected {SCHEMA}")
    for key in ("gpu", "device", "date"):
        if not profile.get(key):
            raise ValueError(f"hardware profile: no {key!r}")
    for block in ("gemm", "grouped_gemm", "attention", "hbm", "host_link", "layers"):
        if profile.get(block) is not None and not profile[block].get("source"):
            raise ValueError(f"hardware profile: {block!r} names no source")
    for row in (profile.get("attention") or {}).get("rows", []):
        if row["kind"] not in ATTENTION_KINDS:
            raise ValueError(f"hardware profile: attention kind {row['kind']!r}; known: {', '.join(ATTENTION_KINDS)}")


def device(gpu: str, profile="stored", gemm_efficiency: float | None = None,
           moe_layer_s: float | None = None) -> "Device":
    """The kernel-time model of ``gpu``: its stored profile (``profile="stored"``), a given profile
    dict, or none (``None``: the datasheet model only). ``gemm_efficiency`` / ``moe_layer_s``
    replace the fitted constants (``hardware``)."""
    from megatron_ext.planner.hardware import GPUS

    if isinstance(profile, str):
        if profile != "stored":
            raise ValueError(f"hardware profile {profile!r}: 'stored', a profile dict or None")
        profile = load(gpu)
    return Device(gpu, GPUS[gpu], profile, gemm_efficiency, moe_layer_s)


def _log_interp(points: list, query: tuple) -> float:
    """log-space multilinear interpolation of values over a rectangular grid of points
    ((coords...), value), clamped at the grid's edges; inverse-distance weighting if not a grid."""
    dims = len(query)
    axes = [sorted({p[0][i] for p in points}) for i in range(dims)]
    grid = {p[0]: math.log(p[1]) for p in points}
    if len(grid) == math.prod(len(a) for a in axes):
        corners = []
        for i, a in enumerate(axes):
            q = min(max(query[i], a[0]), a[-1])
            hi = next((j for j, x in enumerate(a) if x >= q), len(a) - 1)
            lo = max(0, hi - 1) if a[hi] > q else hi
            w = 0.0 if lo == hi else (math.log(q) - math.log(a[lo])) / (math.log(a[hi]) - math.log(a[lo]))
            corners.append(((a[lo], 1 - w), (a[hi], w)))
        total = 0.0
        for pick in range(2 ** dims):
            coord, weight = [], 1.0
            for i in range(dims):
                x, w = corners[i][(pick >> i) & 1]
                coord.append(x)
                weight *= w
            if weight:
                total += weight * grid[tuple(coord)]
        return math.exp(total)
    dist = [(sum((math.log(c) - math.log(q)) ** 2 for c, q in zip(p[0], query)), p[1]) for p in points]
    exact = [v for d, v in dist if d == 0]
    if exact:
        return exact[0]
    weights = [(1 / d, math.log(v)) for d, v in dist]
    return math.exp(sum(w * v for w, v in weights) / sum(w for w, _ in weights))


def _label(profile: dict, block: str) -> str:
    return f"measured: {profile['device']} {profile['date']} ({profile[block]['source']})"


class Device:
    """Kernel times on one GPU kind: from its profile where it measured the kernel class, else from
    the datasheet model. ``sources``: kernel class -> "measured: ..." / "datasheet: ..."."""

    def __init__(self, gpu: str, datasheet: dict, profile: dict | None = None, gemm_efficiency: float | None = None,
                 moe_layer_s: float | None = None):
        from megatron_ext.planner import hardware as hw

        self.gpu, self.datasheet, self.profile = gpu, datasheet, profile
        self.gemm_efficiency = hw.GEMM_EFFICIENCY if gemm_efficiency is None else gemm_efficiency
        self.moe_layer_s = hw.MOE_LAYER_S if moe_layer_s is None else moe_layer_s
        p = profile or {}
        self.hbm = (p["hbm"]["bytes_per_s"] if p.get("hbm") else datasheet["hbm"] * hw.HBM_EFFICIENCY)
        link = p.get("host_link")
        self.host_link = link["d2h_bytes_per_s"] if link else datasheet["host_link"]
        self.host_link_h2d = link["h2d_bytes_per_s"] if link else datasheet["host_link"]
        self._gemm = {dt: [((r["m"], r["n"], r["k"]), 2 * r["m"] * r["n"] * r["k"] / (r["ms"] * 1e-3))
                           for r in (p.get("gemm") or {}).get("rows", []) if r["dtype"] == dt]
                      for dt in ("bfloat16", "float8")}
        self._grouped = {dt: [((r["m"], r["n"], r["k"]), 2 * r["groups"] * r["m"] * r["n"] * r["k"] / (r["ms"] * 1e-3))
                              for r in (p.get("grouped_gemm") or {}).get("rows", []) if r["dtype"] == dt]
                         for dt in ("bfloat16", "float8")}
        self._attention = {k: [r for r in (p.get("attention") or {}).get("rows", []) if r["kind"] == k]
                           for k in ATTENTION_KINDS}
        sheet = f"datasheet: {gpu}"
        eff = f"{self.gemm_efficiency:.0%}"
        self.sources = {
            "gemm": _label(p, "gemm") if self._gemm["bfloat16"] else
            f"{sheet} (peak x {eff}, wave quantisation; bytes at HBM)",
            "grouped_gemm": _label(p, "grouped_gemm") if self._grouped["bfloat16"] else
            (_label(p, "gemm") + ": one product per group at its shape" if self._gemm["bfloat16"] else
             f"{sheet} (as gemm, over all experts)"),
            "attention": {k: (_label(p, "attention") if self._attention[k] else
                              (f"{sheet} (BF16 peak x {hw.ATTENTION_EFFICIENCY:.1%})" if k in FLASH_KINDS else
                               f"{sheet} ({hw.UNFUSED_BYTES_PER_SCORE:.0f} bytes per score at HBM)"))
                          for k in ATTENTION_KINDS},
            "hbm": _label(p, "hbm") if p.get("hbm") else f"{sheet} (x {hw.HBM_EFFICIENCY:.0%})",
            "host_link": _label(p, "host_link") if link else f"{sheet} (PCIe)",
        }

    @property
    def measured(self) -> list:
        """The kernel classes timed from the profile."""
        out = [k for k, v in self.sources.items() if isinstance(v, str) and v.startswith("measured")]
        out += [f"attention {k}" for k, v in self.sources["attention"].items() if v.startswith("measured")]
        return out

    def describe(self) -> str:
        if not self.measured:
            return (f"kernel times from the datasheet model (GEMMs at {self.gemm_efficiency:.0%} of peak; "
                    "no measured profile of this GPU)")
        p = self.profile
        return (f"kernel times: measured on {p['device']} {p['date']} for {', '.join(self.measured)}; "
                "the rest from the datasheet model")

    # ------------------------------------------------------------------ matrix products
    def _peak(self, fp8: bool) -> float:
        return self.datasheet["peak_fp8_flops"] if fp8 else self.datasheet["peak_flops"]

    def _waves(self, tiles: float, k: float) -> float:
        """Share of the SMs the waves of ``tiles`` output tiles keep busy; fewer tiles than SMs are split
        along k (split-K / stream-K, as cuBLAS does) into as many parts as fill the SMs, each part at
        least 512 deep."""
        sms = self.datasheet["sms"]
        if tiles < sms:
            tiles *= max(1, min(sms // tiles, int(k // 512)))
        return tiles / (math.ceil(tiles / sms) * sms)

    @staticmethod
    def _tiles(m: float, n: float) -> float:
        from megatron_ext.planner.hardware import TILE

        a, b = TILE
        return min(math.ceil(m / a) * math.ceil(n / b), math.ceil(m / b) * math.ceil(n / a))

    @staticmethod
    def _bytes(groups, m, n, k, in_elem, out_elem, accumulate) -> float:
        # operands read (each group's weights once), output written (read too when accumulated)
        return groups * (in_elem * (m * k + k * n) + out_elem * m * n * (2 if accumulate else 1))

    def gemm_s(self, m, n, k, fp8=False, out_elem=2, accumulate=False) -> float:
        """Seconds of one [m, k] x [k, n] product: 16-bit operands (one byte with ``fp8``),
        ``out_elem`` bytes per output element, read and written when ``accumulate``."""
        return self.grouped_gemm_s(1, m, n, k, fp8, out_elem, accumulate, grouped=False)

    def grouped_gemm_s(self, groups, m, n, k, fp8=False, out_elem=2, accumulate=False, grouped=True) -> float:
        """Seconds of ``groups`` products of [m, k] x [k, n] in one kernel (m rows per group)."""
        if groups <= 0 or m <= 0 or n <= 0 or k <= 0:
            return 0.0
        flops = 2.0 * groups * m * n * k
        nbytes = self._bytes(groups, m, n, k, 1 if fp8 else 2, out_elem, accumulate)
        table = (self._grouped if grouped else self._gemm)["float8" if fp8 else "bfloat16"]
        if not table and grouped:
            table = self._gemm["float8" if fp8 else "bfloat16"]  # one product per group at its shape
        if table:
            rate = _log_interp(table, (m, n, k))
        else:
            rate = self._peak(fp8) * self.gemm_efficiency * self._waves(groups * self._tiles(m, n), k)
        return max(flops / rate, nbytes / self.hbm)

    # ------------------------------------------------------------------ attention
    def attention_s(self, kind: str, batch, heads, seq, dq, dv, pairs, part="both") -> float:
        """Seconds of one core attention (``part``: "fwd", "bwd" or "both"): ``heads`` query heads
        on this rank, ``pairs`` (query, key) pairs each head computes (s(s+1)/2 causal; fewer in a
        window), q/k head dim ``dq``, v head dim ``dv``."""
        from megatron_ext.planner import hardware as hw

        if kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind {kind!r}; known: {', '.join(ATTENTION_KINDS)}")
        share = {"both": 1.0}
        if kind == "unfused":
            share.update(fwd=UNFUSED_FORWARD_SHARE, bwd=1 - UNFUSED_FORWARD_SHARE)
            scores = batch * heads * seq * seq
            rows = self._attention["unfused"]
            if rows:
                r = min(rows, key=lambda r: abs(math.log(r["seq"] / seq)))
                per_score = r["fwd_bwd_ms"] * 1e-3 / (r["batch"] * r["heads"] * r["seq"] ** 2)
                return share[part] * per_score * scores
            # the s x s traffic (every score, whatever the mask), beside the FLOPs of its two batched
            # products over the full matrix, forward and backward (their s x s operands are in the traffic)
            flops = 3 * 2 * scores * (dq + dv)
            rate = self.datasheet["peak_flops"] * self.gemm_efficiency
            return share[part] * (scores * hw.UNFUSED_BYTES_PER_SCORE / self.hbm + flops / rate)
        f = 1 + FLASH_BACKWARD_OVER_FORWARD
        share.update(fwd=1 / f, bwd=FLASH_BACKWARD_OVER_FORWARD / f)
        flops = f * 2 * batch * heads * pairs * (dq + dv)
        rows = self._attention[kind]
        if rows:
            r = min(rows, key=lambda r: abs(math.log(r["seq"] / seq)))
            docs = r.get("documents", 1)  # a document mask: each document attends within itself
            s = r["seq"] / docs
            meas_pairs = docs * (s * (s + 1) / 2 if r.get("causal", True) else s * s)
            rate = f * 2 * r["batch"] * r["heads"] * meas_pairs * 2 * r["head_dim"] / (r["fwd_bwd_ms"] * 1e-3)
        else:
            rate = self.datasheet["peak_flops"] * hw.ATTENTION_EFFICIENCY
        return share[part] * flops / rate

    # ------------------------------------------------------------------ streaming
    def memory_s(self, nbytes: float) -> float:
        return nbytes / self.hbm
