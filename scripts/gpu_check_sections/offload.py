"""offload: activation offload at PP=1, every module set: peak memory, R, step time, host link."""
from __future__ import annotations

import statistics

import torch

from gpu_check_sections.common import NO_CUDA, claim, cuda, timed_ms


DENSE_SETS = [["core_attention"], ["qkv_linear"], ["attn_proj"], ["qkv_linear", "core_attention", "attn_proj"]]


MOE_SETS = [["router_fc1"], ["moe_act"], ["router_fc2"], ["shared_experts"],
            ["qkv_linear", "core_attention", "attn_proj", "router_fc1", "moe_act", "router_fc2", "shared_experts"]]


def section_offload(size, claims) -> dict:
    from megatron_ext import platform
    from megatron_ext.offload import canonical_modules, theory
    from megatron_ext.offload import manager as om
    from megatron_ext.platform import streams
    from bench import offload as jobs
    from megatron_ext.training import parallel

    dtype = torch.bfloat16 if cuda() else torch.float32
    dtype_bytes = torch.finfo(dtype).bits // 8
    warmup, steps = size["offload_warmup"], size["offload_steps"]
    cases = []

    def step(chunks, c, batches):
        """One forward+backward through megatron-core's schedule (scripts/bench/offload.py's run_step
        without its gradient copy, which would add to the measured device peak)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for p in chunks[0].parameters():
            p.grad.zero_()
        losses = get_forward_backward_func()(
            forward_step_func=jobs._forward_step, data_iterator=iter(batches), model=chunks[0],
            num_microbatches=c["microbatches"], seq_length=c["seq"], micro_batch_size=c["mbs"], forward_only=False,
        )
        return [x["lm loss"] for x in losses]

    def measure(chunks, c, mgr):
        def batches(s):  # fresh copies that only the forward holds, as a data loader's
            return [{k: v.clone() for k, v in b.items()} for b in jobs.batches(c, s)]

        for s in range(warmup):
            step(chunks, c, batches(s))
            if mgr is not None:
                mgr.synchronize()
        peaks, times, losses, grads = [], [], [], None
        before = mgr.stats["offloaded_bytes"] if mgr is not None else 0
        for s in range(warmup, warmup + steps):
            data = batches(s)
            if cuda():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            step_losses = step(chunks, c, data)
            if cuda():
                end.record()
            if mgr is not None:
                mgr.synchronize()
            if cuda():
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
                times.append(start.elapsed_time(end))
            losses += [x.item() for x in step_losses]
            if grads is None:  # the first measured step's gradients, on the host, for bitwise comparison
                grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in chunks[0].named_parameters()}
        per_step = ((mgr.stats["offloaded_bytes"] - before) // steps) if mgr is not None else 0
        return dict(peak=max(peaks) if peaks else NO_CUDA, time_ms=statistics.median(times) if times else NO_CUDA,
                    losses=losses, grads=grads, bytes_per_step=per_step)

    for kind, sets in (("dense", DENSE_SETS), ("moe", MOE_SETS)):
        shape = size["offload"][kind]
        chunks, config, c = jobs.build(**shape)
        try:
            for ch in chunks:  # jobs.build leaves torch's own norms where they were made (the host)
                ch.to(device=platform.current().device, dtype=dtype)
                for p in ch.parameters():
                    p.grad = torch.zeros_like(p)
            off = measure(chunks, c, None)
            for modules in sets:
                group = theory.group_bytes(
                    canonical_modules(modules), kind == "moe", seq=c["seq"], mbs=c["mbs"], hidden=c["hidden"],
                    heads=c["heads"], topk=c["topk"], moe_ffn=c["moe_ffn"], shared_ffn=c["shared"], dtype_bytes=dtype_bytes)
                theo = theory.theoretical_saving(group, 1, None, 0, c["microbatches"], c["layers"], 1)
                options = jobs.offload_options(modules, pool_bytes=max(64 << 20, int(theo * 1.25) + (64 << 20)),
                                               chunk_bytes=4 << 20 if cuda() else 64 << 10,
                                               min_tensor_bytes=64 << 10 if cuda() else 1024, debug=False)
                mgr = om.attach(chunks, options)
                try:
                    on = measure(chunks, c, mgr)
                    stats = dict(mgr.stats)
                finally:
                    om.detach()
                equal = off["losses"] == on["losses"] and all(torch.equal(off["grads"][k], on["grads"][k]) for k in off["grads"])
                row = {
                    "model": kind, "modules": list(modules), "dtype": str(dtype).replace("torch.", ""),
                    "shape": {k: shape[k] for k in ("layers", "hidden", "heads", "seq", "mbs", "microbatches")},
                    "peak_off_bytes": off["peak"], "peak_on_bytes": on["peak"],
                    "theoretical_bytes": theo, "bytes_offloaded_per_step": on["bytes_per_step"],
                    "kept_on_device_bytes": sum(v for k, v in stats.items() if k.startswith("kept_")),
                    "step_ms_off": off["time_ms"], "step_ms_on": on["time_ms"],
                    "grads_bitwise_equal": bool(equal),
                }
                if cuda():
                    saved = off["peak"] - on["peak"]
                    row.update(saved_bytes=saved, R=round(saved / theo, 4) if theo else None,
                               step_overhead=round((on["time_ms"] - off["time_ms"]) / off["time_ms"], 4))
                else:
                    row.update(saved_bytes=NO_CUDA, R=NO_CUDA, step_overhead=NO_CUDA)
                cases.append(row)
        finally:
            om.detach()
            parallel.destroy()
            del chunks

    link = {"status": NO_CUDA}
    if cuda():
        link = {"status": "ok"}
        for n in (4 << 20, size["copy_bytes"]):
            dev_buf = torch.empty(n, dtype=torch.uint8, device="cuda")
            host_buf = streams.host_empty(n)
            d2h = timed_ms(lambda: host_buf.copy_(dev_buf, non_blocking=True), 5)
            h2d = timed_ms(lambda: dev_buf.copy_(host_buf, non_blocking=True), 5)
            link[f"d2h_gbps_{n >> 20}mib"] = round(n / (d2h * 1e-3) / 1e9, 2)
            link[f"h2d_gbps_{n >> 20}mib"] = round(n / (h2d * 1e-3) / 1e9, 2)
    claim(claims, "offload: gradients and losses bit-identical with every module set",
          all(r["grads_bitwise_equal"] for r in cases))
    claim(claims, "offload: bytes leave the device with every module set", all(r["bytes_offloaded_per_step"] > 0 for r in cases))
    claim(claims, "offload: R >= 0.9 (torch.cuda.max_memory_allocated) with every module set",
          all(isinstance(r["R"], float) and r["R"] >= 0.9 for r in cases) if cuda() else NO_CUDA)
    return {"status": "ok", "cases": cases, "host_link": link}
