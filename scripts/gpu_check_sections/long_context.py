"""long_context: context parallelism's per-rank attention kernel time on one device. Each comm type's
share of one rank (megatron_ext/attention/context_parallel.py with ``OneRank(cp, rank)``: the rank's
own kernels, each collective a local copy of the same size) at CP 2 and 4, forward + backward, against
the whole sequence's attention at CP 1 (kernels.attend, causal). The step waits for the slowest rank:
each row is the slowest of the CP ranks. Each rank's kernels are first checked: with every rank holding
this rank's inputs, the sequence is known (each rank's first half in chunks 0 .. CP-1, its second in
CP .. 2CP-1), and the rank's output and dq equal that sequence's attention at the rank's rows (a2a:
at the rank's heads, the others being other ranks' work). On CPU every kernel runs at tiny sizes; what
only a GPU measures reads "skipped: no CUDA"."""
from __future__ import annotations

import sys

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda, interleaved_ms

SHAPES = {  # one layer's core attention: Llama-3-8B's heads (32 queries, 8 KV groups of 128)
    "gpu": dict(batch=1, heads=32, groups=8, head_dim=128, seq=16384, cps=(2, 4), reps=5, dtype=torch.bfloat16),
    "smoke": dict(batch=1, heads=4, groups=2, head_dim=16, seq=64, cps=(2, 4), reps=1, dtype=torch.float32),
}
TARGET = 1.15  # CP 2's slowest rank against half of CP 1's time, for the fastest comm type
TOLERANCE = 2e-2  # ‖Δ‖ / ‖ref‖ of a rank's output and dq against the whole sequence's (bf16 on CUDA)


def _step(attend, q, k, v, dout):
    def run():
        q.grad = k.grad = v.grad = None
        attend(q, k, v).backward(dout)
    return run


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _against_whole_sequence(cpa, kernels, comm, cp, rank, q, k, v, dout, scale) -> float:
    """‖Δ‖ / ‖ref‖ (the larger of output and dq) of one simulated rank against the whole sequence that
    every rank holding these inputs makes."""
    def whole(x):
        half = x.shape[2] // 2
        return torch.cat([x[:, :, :half]] * cp + [x[:, :, half:]] * cp, dim=2)

    qq = q.detach().clone().requires_grad_()
    out = cpa.attend(comm, qq, k.detach(), v.detach(), group=cpa.OneRank(cp, rank), scale=scale, causal=True)
    out.backward(dout)
    fq = whole(q.detach()).requires_grad_()
    ref = kernels.attend(fq, whole(k.detach()), whole(v.detach()), scale=scale, causal=True)
    ref.backward(whole(dout))
    rows = cpa.positions(q.shape[2], cp, rank, q.device)
    pairs = [(out, ref[:, :, rows]), (qq.grad, fq.grad[:, :, rows])]
    if comm == "a2a":  # this rank's heads
        heads = slice(rank * q.shape[1] // cp, (rank + 1) * q.shape[1] // cp)
        pairs = [(a[:, heads], b[:, heads]) for a, b in pairs]
    return max(_rel(a, b) for a, b in pairs)


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
    errors = {}
    for cp in shape["cps"]:
        for comm in cpa.COMM_TYPES:
            for rank in range(cp):
                group, inputs = cpa.OneRank(cp, rank), tensors(s // cp)
                errors[comm, cp, rank] = _against_whole_sequence(cpa, kernels, comm, cp, rank, *inputs, scale)
                cases.append((comm, cp, rank, _step(
                    lambda q, k, v, comm=comm, group=group: cpa.attend(comm, q, k, v, group=group, scale=scale,
                                                                        causal=True), *inputs)))
    print(f"[long_context] checked against the whole sequence: max {max(errors.values()):.2e}", file=sys.stderr,
          flush=True)
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
                         "over_cp1_share": ratio,
                         "max_rel_error": float(f"{max(errors[comm, cp, n] for n in range(cp)):.3g}")})
    best = None
    if cuda():
        best = min((r for r in rows if r["cp"] == 2), key=lambda r: r["over_cp1_share"])
    claim(claims, f"long_context: every comm type's rank at CP 2 and 4 computes the whole sequence's attention at "
          f"its rows (output and dq within {TOLERANCE:g} relative)", max(errors.values()) <= TOLERANCE)
    claim(claims, f"long_context: at CP 2 the fastest comm type's slowest rank takes <= {TARGET} x half of CP 1's "
          "attention time (simulated on one device)", NO_CUDA if best is None else best["over_cp1_share"] <= TARGET)
    return {"status": "ok", "shape": {k: str(v) if k == "dtype" else v for k, v in shape.items()},
            "rows": rows, "fastest_at_cp2": None if best is None else best["comm_type"]}
