"""Sharded data parallelism (ZeRO-3): fetch and release per MoE layer, as a function of the number
of experts.

    .venv/bin/python scripts/bench_fsdp.py [--experts 8 32 128] [--wrappers megatron_fsdp fsdp2] [--json]
    .venv/bin/python scripts/bench_fsdp.py --smoke      # E = 2 and 4, one timed step: seconds (the suite's run)

A stack of megatron-core MoE TransformerLayers (local spec, SequentialMLP experts, EP1: every
expert local) on a 2-process data-parallel world (gloo on CPU, NCCL with CUDA), wrapped by:

  megatron_fsdp / stock  megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel,
                         data_parallel_sharding_strategy="optim_grads_params", megatron-core's code
  megatron_fsdp / ours   the same with our seams (megatron_ext/seams/fsdp_fetch.py)
  fsdp2 / stock          torch.distributed.fsdp.fully_shard on every layer and the root (as
                         megatron.core.distributed.TorchFullyShardedDataParallel does)

Per layer, forward + backward + the gradient sync (one counted step after a warm-up; host time = best
of 5 uncounted steps), see scripts/bench/fsdp.py:
  coll          c10d collectives
  host_ops      aten ops the wrapper adds to the same model's unwrapped step
  slices        the part of host_ops that are slices and views
  copies        the part of host_ops that are copies / concatenations
  pg_copies     copies that read a storage an all-gather wrote (copy after the gather)
  rec_stream    Tensor.record_stream calls;  events: stream / event record, wait, synchronize calls
  host_us       process CPU microseconds added by the wrapper
  fetched / released   bytes of the layer's unsharded parameter storage after its fetch / freed by
                its release (forward)
"""
from __future__ import annotations

import argparse
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import fixed_width  # noqa: E402
from bench.fsdp import WRAPPERS, measure_cases  # noqa: E402
from megatron_ext.measure.launch import run_world  # noqa: E402

DEVICE = "cpu (2 cores), gloo, 2 processes: not measured on GPU"
KEYS = ("E", "impl", "wrapper", "collectives_per_layer", "host_ops_per_layer", "host_us_per_layer",
        "released_bytes_per_layer", "slices_per_layer", "copies_per_layer", "post_gather_copies_per_layer",
        "post_gather_copy_bytes_per_layer", "record_stream_per_layer", "event_calls_per_layer",
        "bytes_before_fetch_per_layer", "bytes_after_fetch_per_layer", "bytes_after_release_per_layer",
        "resident_after_step", "params_per_layer", "param_tensors_per_layer", "collective_names")


SMOKE_EXPERTS = [2, 4]


def case_list(experts, wrappers) -> list:
    cases = []
    for e in experts:
        for w in wrappers:
            cases.append((e, w, False))
            if w == "megatron_fsdp":
                cases.append((e, w, True))
    return cases


def run(experts, wrappers=WRAPPERS, world_size: int = 2, timed: int = 5) -> dict:
    per_rank = run_world(world_size, measure_cases, timeout=900, cases=case_list(experts, wrappers), timed=timed)
    out = []
    for i, c in enumerate(per_rank[0]):
        row = {k: c[k] for k in KEYS}
        # Counts are the same on every rank by construction; time: the slower rank.
        row["host_us_per_layer"] = round(max(r[i]["host_us_per_layer"] for r in per_rank), 1)
        out.append(row)
    return {"device": DEVICE, "world_size": world_size, "layers": per_rank[0][0]["layers"], "cases": out}


def table(out: dict) -> str:
    cols = [("wrapper", 13), ("impl", 5), ("E", 4), ("tensors", 7), ("coll", 5), ("host_ops", 8), ("slices", 7),
            ("copies", 6), ("pg_copies", 9), ("rec_stream", 10), ("events", 6), ("host_us", 8), ("fetched", 8),
            ("released", 8)]
    rows = []
    for c in out["cases"]:
        rows.append([c["wrapper"], c["impl"], c["E"], c["param_tensors_per_layer"], f"{c['collectives_per_layer']:g}",
               f"{c['host_ops_per_layer']:g}", f"{c['slices_per_layer']:g}", f"{c['copies_per_layer']:g}",
               f"{c['post_gather_copies_per_layer']:g}", f"{c['record_stream_per_layer']:g}",
               f"{c['event_calls_per_layer']:g}", f"{c['host_us_per_layer']:.0f}",
               f"{c['bytes_after_fetch_per_layer']:.0f}", f"{c['released_bytes_per_layer']:.0f}"])
    lines = fixed_width(cols, rows)
    lines.append(f"per layer ({out['layers']} layers), forward + backward + gradient sync; device: {out['device']}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--wrappers", nargs="+", default=list(WRAPPERS), choices=list(WRAPPERS))
    p.add_argument("--timed", type=int, default=5, help="uncounted steps timed (best of)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny: E = 2 and 4, one timed step (seconds)")
    a = p.parse_args(argv)
    if a.smoke:
        a.experts, a.timed = SMOKE_EXPERTS, 1
    out = run(a.experts, a.wrappers, timed=a.timed)  # workers log to stderr
    if a.json:
        print(json.dumps(out))
    else:
        print(table(out))


if __name__ == "__main__":
    main()
