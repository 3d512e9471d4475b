"""fp8: FP8 on the local spec (``--fp8-format hybrid --fp8-recipe tensorwise``: torchao's float8 products,
megatron_ext/fp8) against bf16, whole training steps through train.py's bring-up (``Run``), on the
throughput section's Llama-3-8B-shaped case (b) and its MoE case (c) with torch attention: tokens/s,
TFLOP/s and MFU (megatron's FLOP count, against the bf16 matrix-product rate measured in the same run,
as the throughput section reports them), FP8's speed-up over bf16; on a GPU (c) again with the zero-sync
MoE layer (its experts' FP8 products torch._scaled_grouped_mm, torchao's MoE recipe), and that product
against torchao's own; torchtitan's Float8 at (b)'s shape where it runs; then the losses of 50 steps in
FP8 and in bf16 on the same data, on (b)'s shape at 2 layers (on CPU: the (b) rows' own steps). On CPU every case runs at the throughput section's tiny sizes; what
only a GPU measures reads "skipped: no CUDA"."""
from __future__ import annotations

import math
import sys

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda
from gpu_check_sections.throughput import MODELS, STEPS, layers_that_fit, matmul_rate, measure_run, rates, run_argv

FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
ZERO_SYNC = ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless"]
VARIANTS = {"bf16": [], "fp8": FP8, "bf16 zero-sync": ZERO_SYNC, "fp8 zero-sync": ZERO_SYNC + FP8}
CASES = ("b", "c")
ZERO_SYNC_CASES = ("c",)  # on a GPU (on CPU the grouped FP8 product's numbers: tests/fp8/test_linear.py)
SMOKE_CASES = ("b",)  # --cpu-smoke: one case proves the rows' code (the MoE case's FP8 experts: tests/fp8)
SPEEDUP_TARGET = 1.2  # FP8 tokens/s over bf16's on (b)
LOSS_STEPS = {"gpu": 50, "smoke": None}  # smoke: the (b) rows' losses (the same data), no runs of their own
LOSS_LAYERS = 2
LOSS_TOLERANCE = 0.03  # the last loss, relative to bf16's
TITAN_FLOAT8 = "skipped: scripts/bench/titan.py runs torchtitan without its Float8 converter (not wired)"


def _row(case: str, m: dict, layers: int, variant: str, steps: dict, matmul: dict) -> dict:
    row = {"case": case, "variant": variant, "layers": layers, "seq": m["seq"]}
    argv = run_argv(m, layers, "flash", (), steps["warmup"] + steps["measured"] + 1) + VARIANTS[variant]
    try:
        got = measure_run(argv, steps)
    except Exception as e:  # noqa: BLE001 - one case's failure keeps the others
        row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return row
    row.update(status="ok", losses=got["losses"], parameters=got["parameters"], peak_bytes=got["peak_bytes"])
    row.update(rates(got["flops_per_step"], got["tokens_per_step"], got["step_s"], matmul))
    row["finite"] = all(math.isfinite(x) for x in got["losses"])
    return row


def _losses(kind: str, rows: list) -> dict:
    """``LOSS_STEPS`` steps of (b)'s shape at 2 layers in bf16 and in FP8: the same seed, the same mock data
    (on CPU the (b) rows' own steps)."""
    m = MODELS[kind]["b"]
    n = LOSS_STEPS[kind]
    if n is None:
        b = {r["variant"]: r for r in rows if r["case"] == "b"}
        out = {"steps": len(b["bf16"].get("losses", [])), "layers": b["bf16"]["layers"]}
        for variant in ("bf16", "fp8"):
            out[variant] = b[variant].get("losses", b[variant]["status"])
    else:
        out = {"steps": n, "layers": LOSS_LAYERS}
    for variant in ("bf16", "fp8") if n is not None else ():
        argv = run_argv(m, LOSS_LAYERS, "flash", (), n + 1) + VARIANTS[variant]
        try:
            out[variant] = measure_run(argv, dict(warmup=0, measured=n))["losses"]
        except Exception as e:  # noqa: BLE001
            out[variant] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    if isinstance(out["bf16"], list) and isinstance(out["fp8"], list):
        out["last_relative_difference"] = round(abs(out["fp8"][-1] - out["bf16"][-1]) / abs(out["bf16"][-1]), 5)
        out["differ"] = out["fp8"] != out["bf16"]
    return out


def _casts_match_torchao() -> bool | str:
    """The fused (compiled) casts of megatron_ext's FP8 products against torchao's eager cast, bit for bit:
    activations and a weight's transpose, in both FP8 dtypes."""
    if not cuda():
        return NO_CUDA
    from megatron_ext.seams.fp8 import float8_bits, torchao_float8

    _, tensor, utils = torchao_float8()
    gen = torch.Generator(device="cuda").manual_seed(0)
    same = True
    for shape in ((8192, 4096), (4096, 14336), (1000, 4096)):
        t = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
        for x in (t, t.t()):
            for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                scale = utils.amax_to_scale(torch.max(torch.abs(x)), dtype)
                ours = float8_bits(x, scale, dtype)
                theirs = tensor.hp_tensor_and_scale_to_float8(x, scale, dtype)._data
                same &= ours.stride() == theirs.stride() and torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    return bool(same)


def _grouped_matches_torchao() -> tuple:
    """The zero-sync experts' FP8 product (seams/fp8.py float8_grouped_matmul) against torchao's
    _to_fp8_rowwise_then_scaled_grouped_mm, both on torch._scaled_grouped_mm, on expert rows in groups of
    multiples of 16 (as torchao takes them): (output, input gradient and weight gradients bit for bit,
    the error that stopped either, or None)."""
    if not cuda():
        return NO_CUDA, None
    from types import SimpleNamespace

    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    from megatron_ext.seams.fp8 import Float8Recipe, _State, float8_grouped_matmul

    gen = torch.Generator(device="cuda").manual_seed(0)
    counts, hidden, ffn = [512, 0, 1024, 2048, 512], 4096, 2048
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(counts), ffn, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(sum(counts), ffn, generator=gen, device="cuda", dtype=torch.bfloat16)

    def run(product):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = product(xi, wi)
        y.backward(dy)
        return y, xi.grad, wi.grad

    state = _State(Float8Recipe())
    try:
        ours = run(lambda xi, wi: float8_grouped_matmul(
            xi, ends, [SimpleNamespace(weight=we, float8=state, tp_group=None) for we in wi.unbind(0)]))
        theirs = run(lambda xi, wi: _to_fp8_rowwise_then_scaled_grouped_mm(
            xi, wi.transpose(-2, -1), ends, torch.bfloat16, torch.float8_e4m3fn, False))
    except Exception as e:  # noqa: BLE001 - the claim is false, the section's rows still run
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return all(torch.equal(a, b) for a, b in zip(ours, theirs)), None


def section_fp8(size, claims) -> dict:
    kind = size["throughput"]
    steps, models = STEPS[kind], MODELS[kind]
    cases = SMOKE_CASES if kind == "smoke" else CASES
    matmul = matmul_rate(kind)
    layers = {}
    for case in cases:
        m = models[case]
        if m["layers"] is None:
            if cuda():
                torch.cuda.empty_cache()
            layers[case] = layers_that_fit(m, "sdpa", torch.cuda.mem_get_info()[0])["layers"]
        else:
            layers[case] = m["layers"]
    casts = _casts_match_torchao()
    claim(claims, "fp8: the fused (compiled) casts give torchao's eager float8 bits and layout", casts)
    grouped, grouped_error = _grouped_matches_torchao()
    claim(claims, "fp8: the zero-sync experts' FP8 product is torchao's MoE float8 product, bit for bit", grouped)
    rows = []
    for case in cases:
        variants = [v for v in VARIANTS if "zero-sync" not in v or (cuda() and case in ZERO_SYNC_CASES)]
        for variant in variants:
            print(f"[fp8] {case} {variant} layers={layers[case]}", file=sys.stderr, flush=True)
            rows.append(_row(case, models[case], layers[case], variant, steps, matmul))
    rows.append({"case": "b", "variant": "torchtitan float8", "status": TITAN_FLOAT8})
    speedup = {}
    pairs = [(c, "") for c in cases] + [(c, " zero-sync") for c in ZERO_SYNC_CASES if c in cases]
    for case, suffix in pairs:
        found = [next((r for r in rows if r["case"] == case and r["variant"] == v + suffix), None)
                 for v in ("bf16", "fp8")]
        ok = all(r is not None and r["status"] == "ok" for r in found)
        speedup[case + suffix] = (round(found[1]["tokens_per_s"] / found[0]["tokens_per_s"], 3) if cuda() and ok
                                  else NO_CUDA if not cuda() else "skipped: a row failed")
    losses = _losses(kind, rows)
    ran = [r for r in rows if r["variant"] != "torchtitan float8"]
    claim(claims, "fp8: every case ran in bf16 and in FP8 with finite losses",
          all(r["status"] == "ok" and r["finite"] for r in ran))
    claim(claims, f"fp8 (b): FP8 tokens/s >= {SPEEDUP_TARGET} x bf16's on the Llama-3-8B-shaped case",
          speedup["b"] if isinstance(speedup["b"], str) else speedup["b"] >= SPEEDUP_TARGET)
    claim(claims, "fp8 (b): FP8 tokens/s >= 1.0 x torchtitan's Float8 at the same shape",
          TITAN_FLOAT8 if cuda() else NO_CUDA)
    holds = ("skipped: a loss run failed" if "last_relative_difference" not in losses
             else losses["differ"] and losses["last_relative_difference"] <= LOSS_TOLERANCE)
    claim(claims, f"fp8: after {losses['steps']} steps the FP8 loss differs from bf16's and is within "
          f"{LOSS_TOLERANCE:.0%} of it", holds)
    return {"status": "ok", "recipe": " ".join(FP8), "casts_match_torchao": casts, "grouped_matches_torchao": grouped,
            "grouped_error": grouped_error,
            "matmul": matmul, "steps": steps, "rows": rows,
            "speedup": speedup, "losses": losses}
