"""The checkpoint flags megatron_ext adds, and the checks of megatron's checkpoint flags before any
compute."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, add_group, option
from megatron_ext.errors import ConfigError


@dataclasses.dataclass
class CheckpointOptions(Options):
    PREFIX = ""  # --no-ckpt-fallback, --allow-missing-checkpoint, --save-keep-last

    no_ckpt_fallback: bool = False
    """When the checkpoint to resume from is damaged (a file missing, truncated or failing its checksum),
    stop with one line naming it instead of loading the newest intact older one."""

    allow_missing_checkpoint: bool = False
    """Start from fresh weights at iteration 0 when --load holds no checkpoint. Without it such a --load is
    refused (a mistyped path would otherwise train from scratch), except when it is also --save without
    --finetune: the first run of a job that resumes later. megatron's --exit-on-missing-checkpoint refuses
    that case too."""

    save_keep_last: int | None = option(None, Domain(int, 0), "count")
    """Keep only the newest K complete checkpoints under --save (older ones are deleted after each
    successful save; multiples of megatron's --save-retain-interval are kept too). Default: keep all."""


def add_arguments(parser):
    add_group(parser, CheckpointOptions, "megatron_ext: checkpoints",
              "integrity, fallback and retention (docs/checkpointing.md)")
    return parser


def before_validate(args) -> None:
    """What was asked for, before megatron's validate_args changes it."""
    args.async_save_requested = bool(args.async_save)
    args.config_sources["async_save_requested"] = args.config_sources.get("async_save", "default")



def validate(args) -> None:
    keep_last = CheckpointOptions.from_args(args).save_keep_last
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"--save-keep-last={keep_last}: keep at least 1 checkpoint")
    if (args.save or args.load) and args.ckpt_format not in ("torch_dist", "fsdp_dtensor"):
        raise ConfigError(f"--ckpt-format={args.ckpt_format}: megatron_ext saves and loads torch_dist, and "
                          "fsdp_dtensor with --use-megatron-fsdp")
    if (args.save and args.use_megatron_fsdp and args.ckpt_format == "fsdp_dtensor" and args.swiglu
            and args.data_parallel_sharding_strategy in ("optim", "optim_grads")):
        raise ConfigError(
            f"--data-parallel-sharding-strategy={args.data_parallel_sharding_strategy} with --save, "
            "--ckpt-format=fsdp_dtensor and --swiglu: megatron-core's split of the fused SwiGLU fc1 "
            "(fsdp_dtensor_checkpoint.py:317 split_swiglu_linear_fc1) builds DTensor metadata it then "
            "rejects (uneven_dtensor.py:161, measured with tiny_dense at DP2) at the first save; "
            "optim_grads_params saves"
        )
    if args.pretrained_checkpoint and (args.use_megatron_fsdp or args.use_torch_fsdp2):
        raise ConfigError(f"--pretrained-checkpoint={args.pretrained_checkpoint} with a sharded data-parallel "
                          "wrapper: load the base with --finetune --load (a torch_dist checkpoint loads before "
                          "the model is sharded)")
    if args.save_interval is not None and args.save_interval < 1:
        raise ConfigError(f"--save-interval={args.save_interval}: must be >= 1")
    # megatron's validate_args (megatron/training/arguments.py:1740) turns --async-save off unless
    # --use-persistent-ckpt-worker, because megatron.training's async path needs that worker. We drive
    # megatron-core's AsyncCallsQueue ourselves, with its fork-based caller by default: honour the
    # request (recorded by before_validate).
    if getattr(args, "async_save_requested", False):
        args.async_save = True
        args.config_sources["async_save"] = args.config_sources["async_save_requested"]
    from megatron_ext import platform

    if args.async_save and args.use_persistent_ckpt_worker and not platform.current().is_cuda:
        raise ConfigError(
            "--use-persistent-ckpt-worker: not supported on CPU (the spawned worker re-imports megatron "
            "without megatron_ext's CPU shims and hangs); --async-save alone uses a forked writer per save"
        )
