"""long_context: context parallelism's per-rank attention kernel time on one device. Each comm type's
share of one rank (megatron_ext/attention/context_parallel.py with ``OneRank(cp, rank)``: the rank's
own kernels, each collective a local copy of the same size) at CP 2 and 4, forward + backward, against
the whole sequence's attention at CP 1 (kernels.attend, causal). The step waits for the slowest rank:
each row is the slowest of the CP ranks. On CPU every kernel runs once at tiny sizes; what only a GPU
measures reads "skipped: no CUDA"."""
from __future__ import annotations

import sys

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda, interleaved_ms

SHAPES = {  # one layer's core attention: Llama-3-8B's heads (32 queries, 8 KV groups of 128)
    "gpu": dict(batch=1, heads=32, groups=8, head_dim=128, seq=16384, cps=(2, 4), reps=5, dtype=torch.bfloat16),
    "smoke": dict(batch=1, heads=4, groups=2, head_dim=16, seq=64, cps=(2, 4), reps=1, dtype=torch.float32),
}
TARGET = 1.15  # CP 2's slowest rank against half of CP 1's time, for the fastest comm type


def _step(attend, q, k, v, dout):
    def run():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(dout)
    return run


def section_long_context(size, claims) -> dict:
    from megatron_ext.attention import context_parallel as cpa
    from megatron_ext.attention import kernels

    shape = SHAPES[size["throughput"]]
    device = "cuda" if cuda() else "cpu"
    b, h, g, d, s = (shape[k] for k in ("batch", "heads", "groups", "head_dim", "seq"))
    scale = d ** -0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def tensors(seq):
        made = [torch.randn(b, n, seq, d, generator=gen, device=device, dtype=shape["dtype"]) for n in (h, g, g, h)]
        return [t.requires_grad_() for t in made[:3]] + [made[3]]

    cases = [("cp1", 1, 0, _step(lambda q, k, v: kernels.attend(q, k, v, scale=scale, causal=True), *tensors(s)))]
    for cp in shape["cps"]:
        for comm in cpa.COMM_TYPES:
            for rank in range(cp):
                group = cpa.OneRank(cp, rank)
                cases.append((comm, cp, rank, _step(
                    lambda q, k, v, comm=comm, group=group: cpa.attend(comm, q, k, v, group=group, scale=scale,
                                                                        causal=True),
                    *tensors(s // cp))))
    if not cuda():  # the rehearsal: every kernel once
        for *_, fn in cases:
            fn()
    print(f"[long_context] {len(cases)} kernels, seq {s}", file=sys.stderr, flush=True)
    times = interleaved_ms([fn for *_, fn in cases], shape["reps"])
    one = times[0]
    rows = [{"comm_type": "(one rank)", "cp": 1, "slowest_rank": 0, "fwd_bwd_ms": one}]
    for cp in shape["cps"]:
        for comm in cpa.COMM_TYPES:
            mine = [(t, r) for (c, n, r, _), t in zip(cases, times) if c == comm and n == cp]
            if cuda():
                t, r = max(mine, key=lambda x: x[0]["median"])
                ratio = round(t["median"] / (one["median"] / cp), 3)
            else:
                t, r, ratio = NO_CUDA, None, NO_CUDA
            rows.append({"comm_type": comm, "cp": cp, "slowest_rank": r, "fwd_bwd_ms": t,
                         "over_cp1_share": ratio})
    best = None
    if cuda():
        best = min((r for r in rows if r["cp"] == 2), key=lambda r: r["over_cp1_share"])
    claim(claims, f"long_context: at CP 2 the fastest comm type's slowest rank takes <= {TARGET} x half of CP 1's "
          "attention time (simulated on one device)", NO_CUDA if best is None else best["over_cp1_share"] <= TARGET)
    return {"status": "ok", "shape": {k: str(v) if k == "dtype" else v for k, v in shape.items()},
            "rows": rows, "fastest_at_cp2": None if best is None else best["comm_type"]}
