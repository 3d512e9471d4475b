"""transformer_engine: the transformer-engine spec trains with offload hooks; or why not. And megatron's
EP overlap with --delay-wgrad-compute (transformer-engine layers only) passes a CUDA dry run."""
from __future__ import annotations

import os

from gpu_check_sections.common import NO_CUDA, ROOT, claim, cuda, package_version
from gpu_check_sections.train_script import run_train


def delay_wgrad_dry_run(te_importable: bool) -> dict:
    """megatron's EP overlap with --delay-wgrad-compute on transformer-engine layers, validated as a
    2-GPU launch would be (EP2: one GPU cannot run it), with this machine's transformer-engine where
    it imports and assumed where not."""
    import arguments
    from megatron_ext.errors import ConfigError

    argv = ["--recipe", os.path.join(ROOT, "recipes", "tiny_moe.yaml"), "--expert-model-parallel-size", "2",
            "--bf16", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
            "--transformer-impl", "transformer_engine", "--platform", "cuda", "--assume-apex",
            "--world-size", "2", "--dry-run", *([] if te_importable else ["--assume-te"])]
    try:
        args = arguments.parse(argv, exit_on_dry_run=False)
    except ConfigError as e:
        return {"argv": argv, "accepted": False, "refusal": str(e)}
    return {"argv": argv, "accepted": bool(args.delay_wgrad_compute and args.overlap_moe_expert_parallel_comm),
            "transformer_engine": "importable" if te_importable else "assumed (--assume-te)"}


def section_transformer_engine(size, claims) -> dict:
    try:
        import transformer_engine  # noqa: F401
        te_error = None
    except Exception as e:  # noqa: BLE001 - the reason is the result
        te_error = e
    dry = delay_wgrad_dry_run(te_error is None)
    claim(claims, "--delay-wgrad-compute with megatron's EP overlap passes a CUDA dry run (transformer-engine "
          "layers, EP2)", dry["accepted"])
    if te_error is not None:
        claim(claims, "transformer-engine spec trains with offload hooks capturing bytes", "skipped: not importable")
        return {"status": f"skipped: transformer-engine not importable ({type(te_error).__name__}: {te_error})",
                "delay_wgrad_dry_run": dry}
    if not cuda():
        return {"status": NO_CUDA, "delay_wgrad_dry_run": dry}
    run = run_train(["--recipe", os.path.join(ROOT, "recipes", "tiny_dense.yaml"), "--mock-data", "--train-iters", "3",
                     "--log-interval", "1", "--transformer-impl", "transformer_engine", *size["train_extra"],
                     "--activation-offload-modules", "qkv_linear", "core_attention", "attn_proj",
                     "--activation-offload-min-tensor-kb", "1"])
    claim(claims, "transformer-engine spec trains with offload hooks capturing bytes",
          run["finite"] and run["offloaded_bytes"] > 0)
    return {"status": "ok", "version": package_version("transformer-engine"), "delay_wgrad_dry_run": dry, **run}
