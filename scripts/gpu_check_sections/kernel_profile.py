"""kernel_profile: the kernel rates the planner's step time reads, measured on this device, written as
its hardware profile (``megatron_ext/planner/profiles/<gpu>.json``, schema in that package).

    from gpu_check_sections.kernel_profile import section_kernel_profile
    result = section_kernel_profile(size, claims)          # gpu_check's throughput section calls this

measures, with CUDA events (median of ``reps`` after a warm-up):
- matrix products in BF16 (and FP8 through ``torch._scaled_mm`` where the device has it) over a grid of
  m (the tokens: 128 to 32768) x n x k (1024 to 16384);
- grouped products (``torch._grouped_mm``, the experts' kernel here) of 16 experts at small rows per
  expert (64 to 4096) for three expert shapes (gpt-oss's FC1 and FC2, Qwen3-30B-A3B's FC1);
- core attention forward + backward per kind at a few sequence lengths (32 heads of 128, causal, BF16),
  each taken from a one-layer model the run's model-only bring-up builds: megatron's unfused
  ``DotProductAttention`` (the local spec's, --attention-backend unfused), torch SDPA (the local spec's
  with --attention-backend flash), and transformer-engine's fused attention where it imports;
- HBM (a device copy) and the host link (pinned copies each way).

and writes the profile for the GPU kind it recognises (h100, h200, a100, b200, gb200), replacing a
seeded one. With ``--cpu-smoke`` the same code runs at tiny sizes on CPU: its numbers go under
``cpu_smoke`` (host timings of the CPU model, never a GPU figure), the profile's status reads
"skipped: no CUDA", and nothing is written.
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time

import torch

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda, sync, timed_ms

SIZES = {
    "gpu": dict(
        gemm_m=(128, 512, 2048, 8192, 32768), gemm_n=(1024, 4096, 16384), gemm_k=(1024, 4096, 16384),
        grouped_m=(64, 256, 1024, 4096), grouped_groups=16, grouped_nk=((5760, 2880), (2880, 2880), (1536, 2048)),
        attention_seq=(2048, 4096, 8192), unfused_seq=(2048, 4096), heads=32, head_dim=128,
        copy_bytes=1 << 30, link_bytes=256 << 20, reps=5),
    "smoke": dict(
        gemm_m=(8, 32), gemm_n=(16, 32), gemm_k=(16, 32), grouped_m=(4, 8), grouped_groups=2,
        grouped_nk=((16, 8),), attention_seq=(16, 32), unfused_seq=(16,), heads=2, head_dim=8,
        copy_bytes=1 << 20, link_bytes=1 << 20, reps=1),
}
GPU_KINDS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def gpu_kind(device_name: str) -> str | None:
    """The planner's GPU name for a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    upper = device_name.upper()
    return next((kind for mark, kind in GPU_KINDS if mark in upper), None)


def _ms(fn, reps: int) -> float:
    """Median milliseconds of fn: CUDA events on a GPU (common.timed_ms), the host clock on CPU (the smoke)."""
    if cuda():
        return timed_ms(fn, reps)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 5)


def _device():
    return torch.device("cuda") if cuda() else torch.device("cpu")


def gemm_rows(s: dict) -> list:
    dev, rows = _device(), []
    fp8 = cuda() and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)
    for m in s["gemm_m"]:
        for n in s["gemm_n"]:
            for k in s["gemm_k"]:
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                rows.append(dict(dtype="bfloat16", m=m, n=n, k=k, ms=_ms(lambda: a @ b.t(), s["reps"])))
                if fp8:
                    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                    one = torch.ones((), device=dev)
                    rows.append(dict(dtype="float8", m=m, n=n, k=k, ms=_ms(
                        lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        s["reps"])))
                del a, b
    return rows


def grouped_rows(s: dict) -> list:
    dev, rows, g = _device(), [], s["grouped_groups"]
    for n, k in s["grouped_nk"]:
        w = torch.randn(g, k, n, device=dev, dtype=torch.bfloat16)
        for m in s["grouped_m"]:
            x = torch.randn(g * m, k, device=dev, dtype=torch.bfloat16)
            offs = torch.arange(1, g + 1, device=dev, dtype=torch.int32) * m
            rows.append(dict(dtype="bfloat16", groups=g, m=m, n=n, k=k,
                             ms=_ms(lambda: torch._grouped_mm(x, w, offs=offs), s["reps"])))
    return rows


def _local_core_attention(kind: str, heads: int, head_dim: int, seq: int):
    """The core attention the local spec builds for ``kind`` ("unfused": megatron's DotProductAttention;
    "sdpa": torch's, --attention-backend flash), taken from a one-layer model that the run's model-only
    bring-up builds (bench/offload.py's model, BF16, causal): the kernels a run uses."""
    from bench.offload import build

    chunks, _, _ = build(layers=1, hidden=heads * head_dim, heads=heads, ffn=4 * heads * head_dim, seq=seq,
                         attention=kind, dtype="bfloat16")
    model = getattr(chunks[0], "module", chunks[0])  # inside megatron's BF16 wrapper
    attn = model.decoder.layers[0].self_attention.core_attention
    from megatron.core.transformer.enums import AttnMaskType

    return lambda q, k, v: attn(q, k, v, None, AttnMaskType.causal)


def _transformer_engine(heads: int, head_dim: int):
    try:
        import transformer_engine.pytorch as te
    except Exception:  # noqa: BLE001 - absent, or present and broken: either way not measured
        return None
    attn = te.DotProductAttention(heads, head_dim, attn_mask_type="causal", qkv_format="sbhd")
    return lambda q, k, v: attn(q, k, v)


def _time_attention(fn, s: dict, kind: str, seqs) -> list:
    dev, heads, d, rows = _device(), s["heads"], s["head_dim"], []
    for seq in seqs:
        q, k, v = (torch.randn(seq, 1, heads, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(seq, 1, heads * d, device=dev, dtype=torch.bfloat16)

        def step():
            fn(q, k, v).reshape(seq, 1, heads * d).backward(grad)

        rows.append(dict(kind=kind, batch=1, seq=seq, heads=heads, head_dim=d, causal=True,
                         fwd_bwd_ms=_ms(step, s["reps"])))
        del q, k, v, grad
        sync()
    return rows


def attention_rows(s: dict) -> tuple:
    """(rows, skipped kinds with why): forward + backward of each core attention kind."""
    from megatron_ext.training import parallel

    rows = []
    for kind, seqs in (("unfused", s["unfused_seq"]), ("sdpa", s["attention_seq"])):
        try:
            rows += _time_attention(_local_core_attention(kind, s["heads"], s["head_dim"], max(seqs)), s, kind, seqs)
        finally:
            parallel.destroy()
    te = _transformer_engine(s["heads"], s["head_dim"]) if cuda() else None
    if te is not None:
        rows += _time_attention(te, s, "transformer_engine", s["attention_seq"])
        return rows, {}
    return rows, {"transformer_engine": NO_CUDA if not cuda() else "skipped: transformer-engine not importable"}


def hbm(s: dict) -> float:
    n = s["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=_device())
    dst = torch.empty_like(src)
    ms = _ms(lambda: dst.copy_(src), s["reps"])
    return 2 * n / (ms * 1e-3)  # read and written


def host_link(s: dict) -> dict:
    from megatron_ext.platform import streams

    n = s["link_bytes"]
    dev_buf = torch.empty(n, dtype=torch.uint8, device=_device())
    host_buf = streams.host_empty(n) if cuda() else torch.empty(n, dtype=torch.uint8)
    d2h = _ms(lambda: host_buf.copy_(dev_buf, non_blocking=True), s["reps"])
    h2d = _ms(lambda: dev_buf.copy_(host_buf, non_blocking=True), s["reps"])
    return dict(d2h_bytes_per_s=n / (d2h * 1e-3), h2d_bytes_per_s=n / (h2d * 1e-3))


def measure(smoke: bool | None = None, sizes: dict | None = None) -> dict:
    """The profile of this device (``smoke``: tiny sizes; default: on CPU), at SIZES updated by ``sizes``."""
    smoke = (not cuda()) if smoke is None else smoke
    s = dict(SIZES["smoke" if smoke else "gpu"], **(sizes or {}))
    name = torch.cuda.get_device_name() if cuda() else "cpu (smoke)"
    here = "kernel_profile.py (gpu_check)"
    attention, skipped = attention_rows(s)
    link = host_link(s)
    profile = dict(
        schema=1, gpu=gpu_kind(name) if cuda() else "cpu", device=name,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), torch=torch.__version__,
        cuda=torch.version.cuda, source=f"measured by scripts/gpu_check_sections/{here}",
        gemm=dict(source=here, rows=gemm_rows(s)),
        grouped_gemm=dict(source=here + ": torch._grouped_mm", rows=grouped_rows(s)),
        attention=dict(source=here + ": forward + backward, BF16, causal", rows=attention, skipped=skipped),
        hbm=dict(source=here + ": a device copy (read + written)", bytes_per_s=hbm(s)),
        host_link=dict(source=here + ": pinned copies" if cuda() else here + ": host copies", **link),
        layers=None)
    return profile


def write(profile: dict, path: str | None = None) -> str:
    """Store a measured GPU profile where the planner reads it; a CPU (smoke) profile is refused."""
    from megatron_ext.planner import profiles

    if profile.get("gpu") in (None, "cpu") or not cuda():
        raise ValueError("kernel_profile: only a profile measured on a GPU the planner knows is written")
    profiles.check(profile)
    path = path or profiles.path(profile["gpu"])
    with open(path, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    return path


def section_kernel_profile(size, claims, write_profile: bool = True) -> dict:
    """gpu_check's entry: measure (``size["kernel_profile"]``, if the harness's size has it, updates
    SIZES); on a GPU write the profile and claim the planner reads it back."""
    from megatron_ext.planner import profiles
    from megatron_ext.planner.hardware import GPUS

    sizes = (size or {}).get("kernel_profile")

    if not cuda():
        smoke = measure(smoke=True, sizes=sizes)
        # the measured blocks go through the planner's reader as a profile would (CPU numbers, not kept)
        device = profiles.Device("h100", GPUS["h100"], smoke)
        return {"status": NO_CUDA, "cpu_smoke": smoke, "cpu_smoke_read_by_planner": device.measured}
    profile = measure(smoke=False, sizes=sizes)
    out = {"status": "ok", "profile": profile}
    if write_profile and profile["gpu"]:
        out["written"] = os.path.relpath(write(profile), ROOT)
        back = profiles.device(profile["gpu"])
        claim(claims, "kernel_profile: the planner reads the measured profile (GEMM, grouped GEMM, attention, host link)",
              all(k in " ".join(back.measured) for k in ("gemm", "grouped_gemm", "attention", "host_link")))
    elif not profile["gpu"]:
        out["written"] = f"not written: {profile['device']} is no GPU the planner knows"
    return out
