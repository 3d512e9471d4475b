"""Per-rank peak host memory of a Hugging Face import and export on N processes, against the weights.

    .venv/bin/python scripts/bench_convert.py [--sizes 1 2 4] [--layers 12] [--hidden 1024] [--json]
    .venv/bin/python scripts/bench_convert.py --smoke [--json]    # 2 layers, hidden 64, N = 2: seconds

A random Llama-style model (bf16, hidden 1024, FFN 4096, 16 heads in 4 groups, 12 layers, a
640-id vocabulary so that the layers hold the weights; 366 MiB in 100 MB safetensors files) is
made offline with transformers, then for each N on a fresh local world of N processes
(megatron_ext.measure.launch, gloo on CPU):

  import   scripts/convert.py's import under TP=N: each rank builds its shard and reads its slices
  export   the import's checkpoint exported with each rank a pipeline stage of 12/N layers

Per rank: `base`, the resident set once megatron-core is imported (before the conversion), and
`peak`, the process's peak resident set (VmHWM); the table shows the largest of each over the
ranks. `bound` = weights / N + the largest tensor; `over` = peak - bound: what a rank holds beyond
its share of the weights and one tensor (the interpreter, torch, megatron-core, the checkpoint
writer's or reader's buffers). Every export is checked bit for bit against the model's tensors.
Timings and memory come from a shared 2-core machine: other work changes them between runs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform as host
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

MIB = 2**20


def device() -> str:
    return f"{host.machine()} CPU ({os.cpu_count()} cores, shared with other work), gloo: not measured on GPU"


def make_model(root: str, layers: int, hidden: int) -> str:
    """A random bf16 Llama-style model directory with a tokenizer (a byte-level BPE of 600 ids trained
    here on this Python's json package), offline."""
    import sysconfig

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from megatron_ext.sft import example

    corpus = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    texts = [open(path, encoding="utf-8").read() for path in corpus]
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=16, num_key_value_heads=4, vocab_size=640,
                                  max_position_embeddings=4096, tie_word_embeddings=False, dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = os.path.join(root, "hf")
    # no progress bar: its tqdm monitor thread would outlive the save (this log is the lines on stderr)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, max_shard_size="100MB")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    example.make_tokenizer(texts, out, vocab_size=600)
    return out


def _status(field: str) -> int:
    """A /proc/self/status size in bytes. VmHWM, the peak, belongs to this process image: the
    getrusage peak of a spawned process starts at its parent's resident set when it forked."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def convert(step: str, src: str, dst: str, flags: list) -> dict:
    """Job (every rank): one conversion; this rank's resident set before it and its peak."""
    from megatron_ext import hf, platform

    platform.setup()
    import arguments  # megatron-core imported: the baseline holds it

    base = _status("VmRSS")
    t0 = time.perf_counter()
    if step == "import":
        hf.import_hf(src, dst, extra=flags, parse=arguments.parse)
    else:
        hf.export_hf(src, dst, parse=arguments.parse)
    return {"base": base, "peak": _status("VmHWM"),
            "seconds": time.perf_counter() - t0}


def weights(hf_dir: str) -> tuple[int, int]:
    """(bytes of every tensor, bytes of the largest one), from the files' headers."""
    from safetensors import safe_open

    sizes = []
    for path in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                sizes.append(n * {"BF16": 2, "F16": 2, "F32": 4}[sl.get_dtype()])
    return sum(sizes), max(sizes)


def same_tensors(a: str, b: str) -> bool:
    import torch
    from safetensors.torch import load_file

    def read(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    x, y = read(a), read(b)
    return x.keys() == y.keys() and all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)


def run(sizes: list[int], layers: int, hidden: int) -> dict:
    from megatron_ext.measure.launch import run_world

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"making the model ({layers} layers, hidden {hidden}) ...", file=sys.stderr)
        # in a process of its own: its prints go to stderr, and this process never holds the model
        hf_dir = run_world(1, make_model, timeout=900, root=tmp, layers=layers, hidden=hidden)[0]
        total, largest = weights(hf_dir)
        for n in sizes:
            ckpt, out = os.path.join(tmp, f"ckpt{n}"), os.path.join(tmp, f"out{n}")
            for step, src, dst, flags in (("import", hf_dir, ckpt, ["--tensor-model-parallel-size", str(n)]),
                                          ("export", ckpt, out, [])):
                print(f"{step} on {n} process{'es' if n > 1 else ''} ...", file=sys.stderr)
                ranks = run_world(n, convert, timeout=900, step=step, src=src, dst=dst, flags=flags)
                bound = total / n + largest
                peak = max(r["peak"] for r in ranks)
                rows.append({"step": step, "processes": n, "weights_mib": total / MIB, "bound_mib": bound / MIB,
                             "base_mib": max(r["base"] for r in ranks) / MIB, "peak_mib": peak / MIB,
                             "over_mib": (peak - bound) / MIB,
                             "peak_above_base_mib": max(r["peak"] - r["base"] for r in ranks) / MIB,
                             "seconds": max(r["seconds"] for r in ranks),
                             "bitwise": same_tensors(hf_dir, out) if step == "export" else None})
            shutil.rmtree(ckpt)
            shutil.rmtree(out)
    return {"device": device(), "weights_mib": total / MIB, "largest_tensor_mib": largest / MIB,
            "layers": layers, "hidden": hidden, "rows": rows}


def table(result: dict) -> str:
    from bench import fixed_width

    cols = [("step", 6), ("N", 2), ("weights/N", 9), ("bound", 7), ("base", 6), ("peak", 6), ("peak-base", 9),
            ("over", 6), ("s", 5), ("bitwise", 7)]
    body = [[r["step"], r["processes"], f"{r['weights_mib'] / r['processes']:.0f}", f"{r['bound_mib']:.0f}",
             f"{r['base_mib']:.0f}", f"{r['peak_mib']:.0f}", f"{r['peak_above_base_mib']:.0f}",
             f"{r['over_mib']:.0f}", f"{r['seconds']:.1f}", {None: "-", True: "yes", False: "NO"}[r["bitwise"]]]
            for r in result["rows"]]
    lines = fixed_width(cols, body)
    lines.append(f"MiB per rank (the largest over the ranks); weights {result['weights_mib']:.0f} MiB, largest tensor "
                 f"{result['largest_tensor_mib']:.0f} MiB; bound = weights/N + largest tensor; over = peak - bound")
    lines.append(f"device: {result['device']}; one run, noisy")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="seconds: 2 layers, hidden 64, on 2 processes")
    a = p.parse_args(argv)
    if a.smoke:
        a.sizes, a.layers, a.hidden = [2], 2, 64
    result = run(a.sizes, a.layers, a.hidden)
    print(json.dumps(result, indent=1) if a.json else table(result))


if __name__ == "__main__":
    main()
