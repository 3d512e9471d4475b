"""moe_graphs: a dropless MoE model trained with its MoE layers captured in CUDA graphs
(``--cuda-graph-impl local --cuda-graph-modules moe`` with ``--moe-zero-sync-dropless``, bf16) against
the same run eager: the losses of every iteration bit for bit (both with ``--deterministic-mode``), and the
time per iteration once the graphs replay (iterations after the first: it records, and megatron's
schedule captures at its end). On CPU no graph can be captured: the flags pass a CUDA dry run, a CPU
run refuses them by name, and the eager run goes through the same code at the recipe's own sizes."""
from __future__ import annotations

import contextlib
import io
import os
import statistics

import torch

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda

RECIPE = os.path.join(ROOT, "recipes", "tiny_moe.yaml")
ZERO_SYNC = ["--moe-sync-free-dispatcher", "--moe-zero-sync-dropless", "--bf16"]
GRAPHS = ["--cuda-graph-impl", "local", "--cuda-graph-modules", "moe"]
# the GPU run's model: tiny_moe's 4 layers and 8 experts top-2, wider and longer; 2 micro-batches per step
GPU_MODEL = ["--hidden-size", "1024", "--ffn-hidden-size", "2048", "--moe-ffn-hidden-size", "1024",
             "--num-attention-heads", "8", "--seq-length", "1024", "--max-position-embeddings", "1024",
             "--micro-batch-size", "2", "--global-batch-size", "4"]
ITERATIONS = 8
CPU_ITERATIONS = 3  # the rehearsal: the first records, the graphs are captured at its end, the rest replay


def dry_run(*argv) -> str:
    """"accepted", or the refusal line, of a --dry-run of tiny_moe with these flags."""
    import arguments
    from megatron_ext.errors import ConfigError

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            arguments.parse(["--recipe", RECIPE, "--dry-run", *argv], exit_on_dry_run=False)
    except ConfigError as e:
        return str(e)
    return "accepted"


def train(extra, model=tuple(GPU_MODEL), iterations: int = ITERATIONS) -> dict:
    """train.py's main on tiny_moe (at ``model``'s sizes) with the zero-sync layer, deterministic."""
    from train import main as train_main

    from megatron_ext import moe

    argv = ["--recipe", RECIPE, "--mock-data", "--train-iters", str(iterations), "--log-interval", "1",
            "--eval-iters", "0", "--deterministic-mode", *ZERO_SYNC, *model, *extra]
    before = moe.installed
    history = train_main(argv)
    replaying = [h["elapsed ms"] for h in history[2:]]  # the first records, the graphs are captured at its end
    return {"argv": argv, "losses": [h["lm loss"] for h in history], "grad_norms": [h.get("grad norm") for h in history],
            "ms_per_iteration": {"median": round(statistics.median(replaying), 3), "min": round(min(replaying), 3),
                                 "max": round(max(replaying), 3)},
            "dispatchers_replaced": moe.installed - before}


def section_moe_graphs(size, claims) -> dict:
    out = {"status": "ok",
           "cuda_dry_run": dry_run("--platform", "cuda", *ZERO_SYNC, *GRAPHS),
           "cuda_dry_run_without_zero_sync": dry_run("--platform", "cuda", "--bf16", *GRAPHS),
           "cpu_run": dry_run("--platform", "cpu", *ZERO_SYNC, *GRAPHS)}
    claim(claims, "--cuda-graph-impl local --cuda-graph-modules moe: accepted for CUDA with --moe-zero-sync-dropless, "
          "refused by name without it (as megatron refuses it) and where there is no CUDA",
          out["cuda_dry_run"] == "accepted"
          and out["cuda_dry_run_without_zero_sync"].startswith("--cuda-graph-impl=local, --cuda-graph-modules=moe: moe "
                                                                "cuda graph is only supported with drop-padding MoE")
          and out["cpu_run"].startswith("--cuda-graph-impl=local: CUDA graphs need CUDA"))
    if not cuda():
        out["captured"] = NO_CUDA
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:  # the GPU run's code at the recipe's own sizes
            out["eager"] = {"cpu_smoke": train([], model=(), iterations=CPU_ITERATIONS)}
        finally:
            torch.use_deterministic_algorithms(deterministic)
        claim(claims, "a dropless MoE model trains with its MoE layers captured in CUDA graphs, losses bit-identical to "
              "eager (--deterministic-mode)", NO_CUDA)
        claim(claims, "captured MoE layers: time per iteration measured against eager", NO_CUDA)
        return out
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        out["eager"] = train([])
        out["captured"] = train(GRAPHS)
    finally:
        torch.use_deterministic_algorithms(deterministic)  # --deterministic-mode set it for the process
    eager, captured = out["eager"], out["captured"]
    out["time_captured_over_eager"] = round(captured["ms_per_iteration"]["median"] / eager["ms_per_iteration"]["median"], 3)
    claim(claims, "a dropless MoE model trains with its MoE layers captured in CUDA graphs, losses bit-identical to "
          "eager (--deterministic-mode)", captured["losses"] == eager["losses"] and len(eager["losses"]) == ITERATIONS
          and captured["dispatchers_replaced"] > 0)
    claim(claims, "captured MoE layers: time per iteration measured against eager",
          eager["ms_per_iteration"]["median"] > 0 and captured["ms_per_iteration"]["median"] > 0)
    return out
