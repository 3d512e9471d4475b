"""offload: activation offload at PP=1, every module set, dense at several depths and MoE: peak memory
against what offload/theory.py models, step time off and on interleaved (median and spread) against
what the planner predicts from the bytes, the host link and the compute they overlap, gradients."""
from __future__ import annotations

import statistics

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda, sync, timed_ms


DENSE = ["qkv_linear", "core_attention", "attn_proj"]
DENSE_SETS = [["core_attention"], ["qkv_linear"], ["attn_proj"], DENSE, ["dense_mlp"]]
# at the other depths: the sets whose saving and copies matter (the s x s probabilities)
DEPTH_SETS = [["core_attention"], DENSE]
MOE_SETS = [["router_fc1"], ["moe_act"], ["router_fc2"], ["shared_experts"],
            ["qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act", "router_fc2", "shared_experts"]]
SAVED_OF_MODELLED = 0.95
OVERHEAD_TOLERANCE = 0.20


def host_link(size) -> dict:
    """Pinned copies each way, CUDA events: a 4 MiB chunk (the engine's) and a large copy."""
    from megatron_ext.platform import streams

    if not cuda():
        return {"status": NO_CUDA}
    link = {"status": "ok"}
    for n in (4 << 20, size["copy_bytes"]):
        dev_buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        host_buf = streams.host_empty(n)
        d2h = timed_ms(lambda: host_buf.copy_(dev_buf, non_blocking=True), 5)
        h2d = timed_ms(lambda: dev_buf.copy_(host_buf, non_blocking=True), 5)
        link[f"d2h_gbps_{n >> 20}mib"] = round(n / (d2h * 1e-3) / 1e9, 2)
        link[f"h2d_gbps_{n >> 20}mib"] = round(n / (h2d * 1e-3) / 1e9, 2)
        del dev_buf, host_buf
    return link


def _cases(size) -> list:
    """(model, layers, module sets): the dense model at its depth with every set, at the other depths
    with DEPTH_SETS; the MoE with every set. A size with ``offload_all_at_once`` (the CPU rehearsal)
    runs each model with its every module in one set: the same code, each module offloaded."""
    dense = size["offload"]["dense"]
    sets = dict(dense=DENSE_SETS, depth=DEPTH_SETS, moe=MOE_SETS)
    if size.get("offload_all_at_once"):
        sets = dict(dense=[DENSE + ["dense_mlp"]], depth=[DENSE], moe=MOE_SETS[-1:])
    out = [("dense", dense["layers"], sets["dense"])]
    out += [("dense", n, sets["depth"]) for n in size["offload_depths"]]
    out.append(("moe", size["offload"]["moe"]["layers"], sets["moe"]))
    return sorted(out, key=lambda x: (x[0] != "dense", x[1]))


def _spread(values) -> list:
    return [round(min(values), 3), round(max(values), 3)] if values else NO_CUDA


# measured only on a GPU; on CPU the same code measures the CPU model (live tensor bytes, host time,
# the CUDA-faithful copy engine's link) and reports it under "cpu_model", never as these
GPU_ONLY = ("peak_off_bytes", "peak_on_bytes", "peak_spread_bytes", "saved_bytes", "R", "step_ms_off", "step_ms_on",
            "step_ms_off_spread", "step_ms_on_spread", "step_overhead", "step_overhead_spread", "layer_forward_ms",
            "layer_backward_ms", "copy_ms_per_group", "predicted_overhead")


def _links(link, size) -> tuple:
    """(D2H, H2D) bytes/s: gpu_check's measured large copies, or the CPU copy engine's link."""
    from megatron_ext.platform import faithful

    if cuda():
        n = size["copy_bytes"] >> 20
        return link[f"d2h_gbps_{n}mib"] * 1e9, link[f"h2d_gbps_{n}mib"] * 1e9
    gbps = faithful.link_gbps() if faithful.enabled() else float("inf")
    return gbps * 1e9, gbps * 1e9


def timing_row(off: list, on: list, theo: int, layer_s: tuple, per_group: float, copies: float, links: tuple) -> dict:
    """Peaks, step times (medians, [min, max]) and the overhead of interleaved repetitions off and on,
    against the modelled saving and the overhead the planner predicts from the bytes, the links and
    the layer compute measured (``layer_s``: forward, backward)."""
    from megatron_ext.planner import steptime

    peak_off, peak_on = max(r["peak"] for r in off), max(r["peak"] for r in on)
    t_off, t_on = statistics.median(r["ms"] for r in off), statistics.median(r["ms"] for r in on)
    lo = (min(r["ms"] for r in on) - max(r["ms"] for r in off)) / max(r["ms"] for r in off)
    hi = (max(r["ms"] for r in on) - min(r["ms"] for r in off)) / min(r["ms"] for r in off)
    exposed = steptime.offload_exposed(per_group, copies, links[0], layer_s[0], layer_s[1], links[1])
    saved = peak_off - peak_on
    return dict(
        peak_off_bytes=peak_off, peak_on_bytes=peak_on,
        peak_spread_bytes=[max(r["peak"] for r in x) - min(r["peak"] for r in x) for x in (off, on)],
        saved_bytes=saved, R=round(saved / theo, 4) if theo else None,
        step_ms_off=round(t_off, 3), step_ms_on=round(t_on, 3),
        step_ms_off_spread=_spread([r["ms"] for r in off]), step_ms_on_spread=_spread([r["ms"] for r in on]),
        step_overhead=round((t_on - t_off) / t_off, 4), step_overhead_spread=[round(lo, 4), round(hi, 4)],
        layer_forward_ms=round(layer_s[0] * 1e3, 3), layer_backward_ms=round(layer_s[1] * 1e3, 3),
        copy_ms_per_group=round(exposed["copy_s"] * 1e3, 3),
        predicted_overhead=round(exposed["exposed_s"] / (t_off / 1e3), 4))


def _model_rows(kind, layers, sets, size, link) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from bench import offload as jobs
    from megatron_ext import platform
    from megatron_ext.measure.memtrack import CudaPeak, LiveBytesTracker, model_state_ptrs
    from megatron_ext.offload import canonical_modules, theory
    from megatron_ext.offload import manager as om
    from megatron_ext.planner import steptime
    from megatron_ext.training import parallel

    dtype = torch.bfloat16 if cuda() else torch.float32
    dtype_bytes = torch.finfo(dtype).bits // 8
    shape = dict(size["offload"][kind], layers=layers)
    chunks, _config, c = jobs.build(**shape)
    model = chunks[0]
    try:
        for ch in chunks:  # jobs.build leaves torch's own norms where they were made (the host)
            ch.to(device=platform.current().device, dtype=dtype)
            for p in ch.parameters():
                p.grad = torch.zeros_like(p)
        data = jobs.batches(c, 0)  # one batch for every step: the same routing, the same peaks
        groups = {tuple(m): theory.group_bytes(
            canonical_modules(m), kind == "moe", seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"], heads=c["heads"],
            topk=c["topk"], moe_ffn=c["moe_ffn"], shared_ffn=c["shared"], ffn=c["ffn"], dtype_bytes=dtype_bytes,
            attention=c["attention"]) for m in sets}
        resident = [f"{r.what} ({r.groups})" for r in theory.resident_at_peak(1, None, 0, c["microbatches"], c["layers"], 1)]
        modelled = {m: theory.theoretical_saving(g, 1, None, 0, c["microbatches"], c["layers"], 1) for m, g in groups.items()}
        # one pool for every set, room for every layer's group (the engine holds all but the last at
        # once); its 1 GiB pinned segments come back from the host allocator's cache at each attach
        pool = int(max(c["layers"] * g for g in groups.values()) * 1.05) + (64 << 20)
        clock = jobs.LayerEventClock(chunks)
        state = model_state_ptrs(chunks)
        reference = {}

        def options(modules):
            return jobs.offload_options(modules, pool_mb=pool / 2**20, chunk_mb=4.0 if cuda() else 1 / 16,
                                        min_tensor_kb=64.0 if cuda() else 1.0, debug=False)

        def step(modules, timed_layers=False):
            """One forward+backward through megatron-core's schedule, offload on with ``modules``:
            its peak above what was allocated before it (CPU: live tensor bytes), its time (events on
            the compute stream), its losses, its gradients against the first step's."""
            mgr = om.attach(chunks, options(modules)) if modules else None
            try:
                for p in model.parameters():
                    p.grad.zero_()
                batch = iter([{k: v.clone() for k, v in b.items()} for b in data])  # held by the forward only
                sync()
                tracker = CudaPeak() if cuda() else LiveBytesTracker(state, "cpu")
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                clock.active = timed_layers
                with tracker:
                    start.record()
                    losses = get_forward_backward_func()(
                        forward_step_func=jobs._forward_step, data_iterator=batch, model=model,
                        num_microbatches=c["microbatches"], seq_length=c["seq"], micro_batch_size=c["mbs"],
                        forward_only=False)
                    end.record()
                    if mgr is not None:
                        mgr.synchronize()
                clock.active = False
                out = dict(losses=[x["lm loss"].item() for x in losses], peak=tracker.peak, ms=start.elapsed_time(end),
                           offloaded=mgr.stats["offloaded_bytes"] if mgr else 0,
                           kept=sum(v for k, v in mgr.stats.items() if k.startswith("kept_")) if mgr else 0)
            finally:
                if mgr is not None:
                    om.detach()
            if not reference:
                reference.update({n: p.grad.detach().clone() for n, p in model.named_parameters()}, losses=out["losses"])
            diffs = [(p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters()]
            out.update(equal=out["losses"] == reference["losses"] and max(diffs) == 0.0, max_diff=max(diffs))
            return out

        step(None)  # warm: the first step's allocations, the reference gradients
        step(sets[-1])  # warm: the pinned pool, the copy streams
        reps = size["offload_reps"]
        copies = steptime.copied_groups(c["layers"], c["microbatches"], last_stage=True)
        rows = []
        for modules in sets:
            off, on = [], []
            for _ in range(reps):  # interleaved: drift reaches off and on alike
                off.append(step(None, timed_layers=True))
                on.append(step(modules))
            theo = modelled[tuple(modules)]
            row = {"model": kind, "modules": list(modules), "dtype": str(dtype).replace("torch.", ""),
                   "shape": {k: c[k] for k in ("layers", "hidden", "heads", "seq", "mbs", "microbatches")},
                   "reps": reps, "theoretical_bytes": theo, "group_bytes": groups[tuple(modules)],
                   "resident_at_peak": resident,
                   "bytes_offloaded_per_step": on[0]["offloaded"], "kept_on_device_bytes": on[0]["kept"],
                   "grads_bitwise_equal": all(r["equal"] for r in on),
                   "off_repeatable": all(r["equal"] for r in off),
                   "max_abs_grad_diff_off_on": max(r["max_diff"] for r in on),
                   "max_abs_grad_diff_off_off": max(r["max_diff"] for r in off)}
            measured = timing_row(off, on, theo, clock.medians_s(), on[0]["offloaded"] / copies if copies else 0.0,
                                  copies, _links(link, size))
            if cuda():
                row.update(measured)
            else:  # the same code measured the CPU model: reported as such, never as a GPU number
                row.update(dict.fromkeys(GPU_ONLY, NO_CUDA), cpu_model=measured)
            rows.append(row)
        clock.remove()
        return rows
    finally:
        om.detach()
        parallel.destroy()
        del chunks, model


def _overhead_holds(r) -> bool:
    """The prediction within OVERHEAD_TOLERANCE of the measured median overhead, or inside the
    measured A/B spread (run-to-run noise: an overhead near zero, a baseline that swings)."""
    p, m = r["predicted_overhead"], r["step_overhead"]
    lo, hi = r["step_overhead_spread"]
    return abs(p - m) <= OVERHEAD_TOLERANCE * abs(m) or lo <= p <= hi


def _grads_hold(r) -> bool:
    """Bitwise where offload off is bitwise run to run; elsewhere within off's own spread."""
    if r["off_repeatable"]:
        return r["grads_bitwise_equal"]
    return r["max_abs_grad_diff_off_on"] <= r["max_abs_grad_diff_off_off"]


def section_offload(size, claims) -> dict:
    import traceback

    link = host_link(size)  # first: the overhead prediction reads it
    cases, failed = [], []
    for kind, layers, sets in _cases(size):
        try:  # one model's failure (out of memory at 16 layers, say) keeps the others' rows
            cases += _model_rows(kind, layers, sets, size, link)
        except Exception as e:  # noqa: BLE001 - reported, and the claim below fails
            failed.append({"model": kind, "layers": layers, "error": f"{type(e).__name__}: {e}",
                           "traceback": traceback.format_exc()})
    claim(claims, "offload: every model and depth ran", not failed)
    claim(claims, "offload: gradients and losses bit-identical to offload off with every module set, where offload "
          "off is bit-identical run to run (else: within its own spread)", all(_grads_hold(r) for r in cases))
    claim(claims, "offload: bytes leave the device with every module set", all(r["bytes_offloaded_per_step"] > 0 for r in cases))
    depths = sorted({r["shape"]["layers"] for r in cases if r["model"] == "dense"})
    claim(claims, f"offload: saved >= {SAVED_OF_MODELLED} x the modelled saving (offload/theory.py, peak inside a "
          f"layer's backward; torch.cuda.max_memory_allocated), dense at {'/'.join(map(str, depths))} layers and MoE, "
          "every module set",
          all(isinstance(r["R"], float) and r["R"] >= SAVED_OF_MODELLED for r in cases) if cuda() else NO_CUDA)
    claim(claims, f"offload: step-time overhead predicted (planner/steptime.py: bytes, measured host link, measured layer "
          f"compute) within {OVERHEAD_TOLERANCE:.0%} of the median, or within the A/B spread, every module set",
          all(_overhead_holds(r) for r in cases) if cuda() else NO_CUDA)
    return {"status": "ok", "cases": cases, "failed": failed, "host_link": link}
