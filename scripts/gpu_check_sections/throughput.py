"""throughput: whole training steps (train.py's bring-up, ``Run``: the model, megatron's optimizer and
schedule, mock data), timed on the device: tokens/s, model TFLOP/s and MFU against the bf16 matrix-product
rate measured in the same run.

Cases (``MODELS``), each run unfused and with torch attention (``--attention-backend unfused`` / ``flash``),
core_attention offload off and on:

* ``a``: gpu_check's dense model (scripts/bench/offload.py's: 8 layers, hidden 4096, FFN 16384 GELU,
  32 heads, seq 4096, LayerNorm, learned positions, untied embeddings, the softmax in fp32, vocabulary
  32000), with train.py's kernel defaults (not the benchmark's UNFUSED);
* ``b``: a Llama-3-8B-shaped stack: hidden 4096, FFN 14336 SwiGLU, 32 heads in 8 query groups, RoPE
  (base 500000), RMSNorm, untied embeddings, vocabulary 128256, seq 8192, as many layers as fit this
  GPU's free memory (``layers_that_fit``: the arithmetic, per attention kernel); beside it torchtitan's
  Llama-3 training step at the same shape (scripts/bench/titan.py, its own process);
* ``c``: gpu_check's MoE (4 layers, 8 experts top-2 of FFN 4096, a shared expert of 4096, megatron's
  alltoall dispatcher), otherwise as ``a``.

All at micro-batch 1, global batch 1, bf16. The unfused run with offload off is the baseline: every
feature of this project off (megatron-core's local spec as it ships). FLOPs: megatron's own
``num_floating_point_operations`` (FLOP_CONVENTION). Step time: the whole iteration (schedule and
optimizer), synchronised, median of the measured steps after warm-up ones; forward+backward alone: CUDA
events around the schedule (a Run probe). Peak: ``torch.cuda.max_memory_allocated`` over the measured steps.
Before the cases: the planner's hardware profile (kernel_profile.py: matrix products, grouped products,
attention per kind, HBM, the host link), written to megatron_ext/planner/profiles/<gpu>.json and kept in
the section's result (``kernel_profile.profile``), the copy that comes back from a device run.
On CPU every case runs at tiny sizes; what only a GPU measures reads "skipped: no CUDA"."""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda, interleaved_ms, sync
from gpu_check_sections.kernel_profile import section_kernel_profile

FLOP_CONVENTION = ("megatron's num_floating_point_operations (megatron/training/training.py): every GEMM 3 times "
                   "(forward, data and weight gradients), 2 FLOPs per multiply-add, causal core attention at half "
                   "its full-matrix FLOPs (QK^T and PV over the lower triangle), logits included; the same count "
                   "for torchtitan's step at the same shape")
BASELINE = "unfused attention, offload off: every feature of this project off"
MFU_TARGET = 0.55
A_FWD_BWD_TARGET_MS = 85.0  # on an H200; today's 156 ms: docs/gpu/2026-11-28-h200-4d4d546-gpu_check.json
OFFLOAD_TARGET = 0.05
VARIANTS = (("unfused", ()), ("flash", ()), ("unfused", ("core_attention",)), ("flash", ("core_attention",)))
SMOKE_BC = (("flash", ("core_attention",)),)  # (b) and (c) in --cpu-smoke: their shapes' flags and pool
BYTES_PER_PARAMETER = 18  # bf16 weight, fp32 gradient buffer, fp32 main weight, Adam's two fp32 moments

MODELS = {
    "gpu": {
        "a": dict(arch="gpt", layers=8, hidden=4096, ffn=16384, heads=32, seq=4096, vocab=32000),
        "b": dict(arch="llama", layers=None, hidden=4096, ffn=14336, heads=32, groups=8, seq=8192, vocab=128256),
        "c": dict(arch="gpt", layers=4, hidden=4096, ffn=16384, heads=32, seq=4096, vocab=32000, experts=8, topk=2,
                  moe_ffn=4096, shared=4096),
    },
    "smoke": {
        "a": dict(arch="gpt", layers=2, hidden=64, ffn=256, heads=4, seq=64, vocab=512),
        "b": dict(arch="llama", layers=2, hidden=64, ffn=224, heads=4, groups=2, seq=128, vocab=512),
        "c": dict(arch="gpt", layers=2, hidden=64, ffn=128, heads=4, seq=64, vocab=512, experts=4, topk=2, moe_ffn=64,
                  shared=64),
    },
}
STEPS = {"gpu": dict(warmup=2, measured=5), "smoke": dict(warmup=0, measured=1)}
CASE_RESERVE_S = 40.0  # a case is started only with this much of the section's time limit left
TITAN_TIMEOUT_S = {"gpu": 150.0, "smoke": 60.0}


# ------------------------------------------------------------------------------------------------ shapes
def model_argv(m: dict, layers: int) -> list:
    """The model's megatron flags."""
    argv = ["--num-layers", str(layers), "--hidden-size", str(m["hidden"]), "--ffn-hidden-size", str(m["ffn"]),
            "--num-attention-heads", str(m["heads"]), "--seq-length", str(m["seq"]),
            "--max-position-embeddings", str(m["seq"]), "--vocab-size", str(m["vocab"]),
            "--make-vocab-size-divisible-by", "1", "--untie-embeddings-and-output-weights"]
    if m["arch"] == "llama":
        argv += ["--group-query-attention", "--num-query-groups", str(m["groups"]), "--swiglu", "--normalization",
                 "RMSNorm", "--position-embedding-type", "rope", "--rotary-base", "500000"]
    else:  # scripts/bench/offload.py's GPT (model_flags): GELU, LayerNorm, learned positions, softmax in fp32
        argv += ["--position-embedding-type", "learned_absolute", "--attention-softmax-in-fp32"]
    if m.get("experts"):
        argv += ["--num-experts", str(m["experts"]), "--moe-router-topk", str(m["topk"]),
                 "--moe-ffn-hidden-size", str(m["moe_ffn"]), "--moe-shared-expert-intermediate-size", str(m["shared"]),
                 "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
                 "--moe-aux-loss-coeff", "1e-2"]
    return argv


def run_argv(m: dict, layers: int, backend: str, offload: tuple, iterations: int) -> list:
    argv = model_argv(m, layers) + [
        "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1",
        "--train-iters", str(iterations), "--lr", "1e-4", "--min-lr", "1e-5", "--clip-grad", "1.0",
        "--init-method-std", "0.02", "--attention-dropout", "0", "--hidden-dropout", "0", "--disable-bias-linear",
        "--transformer-impl", "local", "--attention-backend", backend, "--eval-iters", "0", "--log-interval", "1000",
        "--seed", "1234", "--num-workers", "0", *(["--bf16"] if cuda() else [])]
    if offload:
        argv += ["--activation-offload-modules", *offload, "--activation-offload-pool-mb",
                 str(math.ceil(offload_pool_bytes(m, layers, backend) / 2**20)),
                 "--activation-offload-min-tensor-kb", "64" if cuda() else "1"]
    return argv


def _kernel(backend: str) -> str:
    return "unfused" if backend in ("unfused", "local") else "sdpa"


def offload_pool_bytes(m: dict, layers: int, backend: str) -> int:
    """Every layer's core_attention group (offload/theory.py), 5 % and 64 MiB more: the pool never fills."""
    from megatron_ext.offload import theory

    kind = _kernel(backend)
    bf16 = cuda()
    group = theory.group_bytes(["core_attention"], bool(m.get("experts")), attention=kind, seq=m["seq"], mbs=1,
                               hidden=m["hidden"], heads=m["heads"], dtype_bytes=2 if bf16 else 4, softmax_fp32=bf16)
    return int(layers * group * 1.05) + (64 << 20)


def parameters(m: dict) -> tuple:
    """(parameters per layer, parameters outside the layers) of a dense stack as ``model_argv`` builds it
    (no linear biases, untied embeddings; LayerNorm has a bias, RMSNorm not; gpt: learned positions)."""
    h, kv = m["hidden"], m["hidden"] * m.get("groups", m["heads"]) // m["heads"]
    norm = h if m["arch"] == "llama" else 2 * h
    attention = h * (h + 2 * kv) + h * h
    mlp = h * m["ffn"] * (3 if m["arch"] == "llama" else 2)
    embeddings = 2 * m["vocab"] * h + (m["seq"] * h if m["arch"] == "gpt" else 0)
    return attention + mlp + 2 * norm, embeddings + norm


def layers_that_fit(m: dict, kernel: str, free_bytes: int) -> dict:
    """As many layers as fit ``free_bytes`` (this GPU's free memory, 90 % of it usable) with ``kernel``'s
    attention: per layer its parameters' 18 bytes (BYTES_PER_PARAMETER) and what one layer keeps for
    backward in bf16 (per token: 7 hidden + 3 key/value + 3 FFN activations, 15 % more for what this
    count leaves out; unfused adds the [heads, s, s] probabilities in bf16 and their fp32 softmax);
    once: the embeddings' 18 bytes per parameter, the logits' 10 bytes each (bf16 logits, the fp32
    loss and its gradient) and one layer's transient peak (unfused: the fp32 scores, 10 bytes per
    probability; else 2 GB)."""
    per_layer_params, outside = parameters(m)
    h, s, heads = m["hidden"], m["seq"], m["heads"]
    kv = h * m.get("groups", heads) // heads
    act = 1.15 * s * (7 * h + 3 * kv + 3 * m["ffn"]) * 2
    transient = 2e9
    if kernel == "unfused":
        act += heads * s * s * (2 + 4) + 2 * s * h * 2  # probabilities (bf16 and fp32), keys/values repeated per head
        transient = heads * s * s * 10
    fixed = BYTES_PER_PARAMETER * outside + s * m["vocab"] * 10 + transient
    per_layer = BYTES_PER_PARAMETER * per_layer_params + act
    usable = 0.9 * free_bytes
    layers = max(0, min(32, int((usable - fixed) // per_layer)))
    return {"layers": layers, "free_bytes": int(free_bytes), "per_layer_bytes": int(per_layer), "fixed_bytes": int(fixed),
            "predicted_peak_bytes": int(fixed + layers * per_layer)}


# ------------------------------------------------------------------------------------------------ measuring
def matmul_rate(size: str) -> dict:
    """bf16 [8192 x 8192] x [8192 x 8192] on this GPU: TFLOP/s, median of 20 after 5 warm-ups (CUDA events)."""
    if not cuda():
        return {"status": NO_CUDA, "tflops": NO_CUDA}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(4):  # and interleaved_ms's own warm-up: 5
        a @ b
    (ms,) = interleaved_ms([lambda: a @ b], 20)
    del a, b
    return {"status": "ok", "shape": [n, n, n], "dtype": "bfloat16", "reps": 20,
            "tflops": round(2 * n ** 3 / (ms["median"] * 1e-3) / 1e12, 1),
            "tflops_best": round(2 * n ** 3 / (ms["min"] * 1e-3) / 1e12, 1)}


class StepClock:
    """A Run probe: each step's wall time (synchronised at both ends) and its forward+backward's (CUDA
    events around the schedule; host time on CPU)."""

    def __init__(self):
        self.steps, self.schedules = [], []

    @contextlib.contextmanager
    def around_step(self, run, iteration):
        sync()
        t = time.perf_counter()
        yield
        sync()
        self.steps.append(time.perf_counter() - t)

    @contextlib.contextmanager
    def around_schedule(self, run, iteration):
        if cuda():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.schedules.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.schedules.append(time.perf_counter() - t)

    def schedule_s(self) -> list:
        return [start.elapsed_time(end) / 1e3 for start, end in self.schedules] if cuda() else list(self.schedules)


def _spread_ms(seconds: list) -> dict:
    ms = [x * 1e3 for x in seconds]
    return {"median": round(statistics.median(ms), 3), "min": round(min(ms), 3), "max": round(max(ms), 3)}


def measure_run(argv: list, steps: dict) -> dict:
    """One Run: warm-up steps, then measured ones; what it built and what the steps took."""
    from megatron_ext import offload
    from megatron_ext.training.run import Run
    from megatron.training.training import num_floating_point_operations

    import arguments

    clock = StepClock()
    out = {}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            run = Run.from_argv(argv, probes=[clock], parse=arguments.parse)
        with run:
            args = run.args
            model = run.build()
            out["attention_kernel"] = args.attention_kernel  # what --attention-backend resolved to (attention/)
            out["core_attention_module"] = sorted({type(m).__name__ for c in model for n, m in c.named_modules()
                                                   if n.endswith("core_attention")})
            out["parameters"] = sum(p.numel() for c in model for p in c.parameters())
            losses = [run.step() for _ in range(steps["warmup"])]
            clock.steps.clear()
            clock.schedules.clear()
            if cuda():
                torch.cuda.reset_peak_memory_stats()
            manager = offload.current()
            offloaded_before = manager.stats["offloaded_bytes"] if manager is not None else 0
            losses += [run.step() for _ in range(steps["measured"])]
            sync()
            out["losses"] = [round(float(r.lm_loss), 5) for r in losses]
            out["offloaded_bytes_per_step"] = ((manager.stats["offloaded_bytes"] - offloaded_before) // steps["measured"]
                                               if manager is not None else 0)
            out["flops_per_step"] = float(num_floating_point_operations(args, args.global_batch_size))
            out["tokens_per_step"] = args.global_batch_size * args.seq_length
            out["step_s"], out["schedule_s"] = list(clock.steps), clock.schedule_s()
            out["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda() else NO_CUDA
    finally:
        offload.detach()
        gc.collect()
        if cuda():
            torch.cuda.empty_cache()
    return out


def rates(flops: float, tokens: int, step_s: list, matmul: dict) -> dict:
    """tokens/s, TFLOP/s and MFU of a median step."""
    if not cuda():
        return dict(step_ms=NO_CUDA, tokens_per_s=NO_CUDA, tflops=NO_CUDA, mfu=NO_CUDA)
    t = statistics.median(step_s)
    tflops = flops / t / 1e12
    return dict(step_ms=_spread_ms(step_s), tokens_per_s=round(tokens / t, 1), tflops=round(tflops, 1),
                mfu=round(tflops / matmul["tflops"], 4))


def run_row(case: str, m: dict, layers: int, backend: str, offload: tuple, steps: dict, matmul: dict) -> dict:
    row = {"case": case, "variant": f"{backend}{' + offload ' + ' '.join(offload) if offload else ''}",
           "attention_backend": backend, "offload": list(offload), "layers": layers, "seq": m["seq"],
           "baseline": backend == "unfused" and not offload}
    if layers < 1:
        row["status"] = "skipped: not one layer fits this GPU's memory with this attention (layers_that_fit)"
        return row
    try:
        got = measure_run(run_argv(m, layers, backend, offload, steps["warmup"] + steps["measured"] + 1), steps)
    except Exception as e:  # noqa: BLE001 - one case's failure (out of memory, say) keeps the others
        import traceback

        row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                   traceback=traceback.format_exc())
        return row
    row.update(status="ok", **{k: v for k, v in got.items() if k not in ("step_s", "schedule_s")})
    row.update(rates(got["flops_per_step"], got["tokens_per_step"], got["step_s"], matmul))
    row["fwd_bwd_ms"] = _spread_ms(got["schedule_s"]) if cuda() else NO_CUDA
    row["finite"] = all(math.isfinite(x) for x in got["losses"])
    return row


def run_titan(m: dict, layers: int, steps: dict, timeout_s: float, flops_per_step: float | None, matmul: dict) -> list:
    """torchtitan's Llama-3 training step at (b)'s shape, in a process of its own (scripts/bench/titan.py);
    where torchtitan is not installed, that script's measure() reports it here, no process started."""
    with tempfile.TemporaryDirectory(prefix="titan_") as tmp:
        out = os.path.join(tmp, "titan.json")
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench", "titan.py"), "--layers", str(layers),
               "--hidden", str(m["hidden"]), "--ffn", str(m["ffn"]), "--heads", str(m["heads"]),
               "--kv-heads", str(m["groups"]), "--seq", str(m["seq"]), "--vocab", str(m["vocab"]), "--batch", "1",
               "--warmup", str(steps["warmup"]), "--steps", str(steps["measured"]), "--json", out]
        if importlib.util.find_spec("torchtitan") is None:  # its import fails at once: its run says so here
            from bench import titan

            runs = [titan.measure(titan.parse_args(cmd[2:]))]
            return _titan_rows(runs, m, layers, flops_per_step, matmul)
        try:
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL,
                                  timeout=timeout_s, cwd=ROOT)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            return [{"case": "b", "variant": "torchtitan", "layers": layers,
                     "status": f"error: stopped after {timeout_s:.0f} s"}]
        if not os.path.exists(out):
            return [{"case": "b", "variant": "torchtitan", "layers": layers,
                     "status": f"error: scripts/bench/titan.py exited with code {code} and no result"}]
        with open(out) as f:
            runs = json.load(f)["runs"]
    return _titan_rows(runs, m, layers, flops_per_step, matmul)


def _titan_rows(runs: list, m: dict, layers: int, flops_per_step: float | None, matmul: dict) -> list:
    rows = []
    for r in runs:
        row = {"case": "b", "variant": f"torchtitan {r['mode']}", "layers": layers, "seq": m["seq"], **r}
        row.pop("mode", None)
        if r.get("status") == "ok":
            step_s = row.pop("step_s")
            row.update(rates(flops_per_step or float("nan"), m["seq"], step_s, matmul))
            if not flops_per_step:  # the FLOPs come from our run of the same shape
                row.update(tflops="skipped: our (b) run did not run", mfu="skipped: our (b) run did not run")
            row["finite"] = all(math.isfinite(x) for x in row["losses"])
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------ section
def run_order(kind: str) -> list:
    """(case, backend, offload) in the order they run, the most wanted first (a section that reaches its
    time limit skips the rest): (a) and (b) with torch attention, (a) unfused, (c), (b) unfused last (its
    s x s probabilities leave room for few layers). On CPU (b) and (c) run torch attention with offload
    only (their shapes' flags, the offload pool sized for them): the other variants' code is (a)'s."""
    order = [(c, b, o) for c in ("a", "b") for b, o in VARIANTS if not (c == "b" and b == "unfused")]
    order += [("c", b, o) for b, o in VARIANTS] + [("b", b, o) for b, o in VARIANTS if b == "unfused"]
    if kind == "smoke":
        order = [x for x in order if x[0] == "a" or x[1:] in SMOKE_BC]
    return order


def _find(rows, case, backend, offload=()):
    return next((r for r in rows if r.get("case") == case and r.get("attention_backend") == backend
                 and tuple(r.get("offload", ())) == tuple(offload)), None)


def _ok(*rows) -> str | None:
    """None if every row measured, else the first reason one did not."""
    for r in rows:
        if r is None:
            return "skipped: not run"
        if r.get("status") != "ok":
            return r["status"] if r["status"].startswith("skipped") else f"skipped: a row failed ({r['status']})"
    return None


def section_throughput(size, claims) -> dict:
    kind = size["throughput"]
    steps, models = STEPS[kind], MODELS[kind]
    t0, limit = time.time(), size.get("time_limit_s") or float("inf")
    matmul = matmul_rate(kind)
    # the planner's hardware profile first (about 20 s on a GPU): the cases after it stop at the limit
    profile = section_kernel_profile(size, claims)
    if cuda():
        torch.cuda.empty_cache()  # the free memory the layers are counted from
    fits = {}
    layers = {"a": {}, "b": {}, "c": {}}
    for case, m in models.items():
        for backend in ("unfused", "flash"):
            if m["layers"] is None:  # as many as fit this GPU with this attention
                fits[backend] = layers_that_fit(m, _kernel(backend), torch.cuda.mem_get_info()[0])
                layers[case][backend] = fits[backend]["layers"]
            else:
                layers[case][backend] = m["layers"]
    rows = []
    order = run_order(kind)
    titan_after = next(x for x in order if x[0] == "b")  # torchtitan right after our first (b) row
    for case, backend, offload in order:
        if time.time() - t0 > limit - CASE_RESERVE_S:
            rows.append({"case": case, "attention_backend": backend, "offload": list(offload),
                         "variant": f"{backend}{' + offload ' + ' '.join(offload) if offload else ''}",
                         "status": f"skipped: the section's time limit ({limit:.0f} s)"})
            continue
        print(f"[throughput] {case} {backend} offload={list(offload)} layers={layers[case][backend]}", file=sys.stderr,
              flush=True)
        rows.append(run_row(case, models[case], layers[case][backend], backend, offload, steps, matmul))
        if (case, backend, offload) == titan_after:
            ours = rows[-1]
            left = limit - (time.time() - t0) - CASE_RESERVE_S / 2  # it must end before the section's limit
            rows += run_titan(models["b"], layers["b"]["flash"], steps, max(5.0, min(TITAN_TIMEOUT_S[kind], left)),
                              ours.get("flops_per_step"), matmul)
    _claims(claims, rows, models, kind)
    return {"status": "ok", "flop_convention": FLOP_CONVENTION, "baseline": BASELINE, "matmul": matmul,
            "kernel_profile": profile, "b_layers_that_fit": fits or "skipped: fixed sizes on CPU", "steps": steps, "rows": rows}


def _claims(claims, rows, models, kind) -> None:
    ran = [r for r in rows if not r.get("variant", "").startswith("torchtitan")]
    claim(claims, "throughput: every case ran (or was skipped for a stated reason) with finite losses",
          all(r["status"].startswith("skipped") or (r["status"] == "ok" and r["finite"]) for r in ran))
    device = torch.cuda.get_device_name() if cuda() else ""
    for case in ("a", "b"):
        r = _find(rows, case, "flash")
        why = NO_CUDA if not cuda() else _ok(r)
        claim(claims, f"throughput ({case}): MFU >= {MFU_TARGET:.0%} with torch attention (megatron's FLOP formula, "
              "causal attention at half; against the bf16 matrix product measured in this run)",
              why or r["mfu"] >= MFU_TARGET)
    r = _find(rows, "a", "flash")
    why = NO_CUDA if not cuda() else ("skipped: the target is for an H200 (this is " + device + ")"
                                      if "H200" not in device else _ok(r))
    claim(claims, f"throughput (a): forward+backward <= {A_FWD_BWD_TARGET_MS:.0f} ms with torch attention on an H200 "
          "(156 ms unfused on tree 4d4d546)", why or r["fwd_bwd_ms"]["median"] <= A_FWD_BWD_TARGET_MS)
    for case in ("a", "b", "c"):
        off, on = _find(rows, case, "flash"), _find(rows, case, "flash", ("core_attention",))
        why = NO_CUDA if not cuda() else _ok(off, on)
        claim(claims, f"throughput ({case}): core_attention offload with torch attention costs <= {OFFLOAD_TARGET:.0%} "
              "step time (medians)", why or on["step_ms"]["median"] <= (1 + OFFLOAD_TARGET) * off["step_ms"]["median"])
    unfused, flash = _find(rows, "a", "unfused"), _find(rows, "a", "flash")
    why = NO_CUDA if not cuda() else _ok(unfused, flash)
    m = models["a"]
    probs = m["layers"] * m["heads"] * m["seq"] ** 2 * 2
    claim(claims, "throughput (a): torch attention's peak memory is lower than the unfused attention's by at least the "
          f"[heads, s, s] probabilities in bf16 ({probs / 2**30:.1f} GiB over {m['layers']} layers)",
          why or unfused["peak_bytes"] - flash["peak_bytes"] >= probs)
    ours = _find(rows, "b", "flash")
    titan = next((r for r in rows if r.get("variant") == "torchtitan eager"), None)
    why = NO_CUDA if not cuda() else _ok(ours, titan)
    claim(claims, "throughput (b): tokens/s >= 1.0 x torchtitan's (eager, its own Llama-3 model and step) on this GPU "
          "in this run", why or ours["tokens_per_s"] >= titan["tokens_per_s"])
