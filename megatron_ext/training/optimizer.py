"""megatron-core optimizer (distributed optimizer when --use-distributed-optimizer) and the LR schedule
megatron.training builds: iteration-based (--train-iters, --lr-decay-iters, --lr-warmup-iters) or
sample-based (--train-samples, --lr-decay-samples, --lr-warmup-samples), with its own arithmetic;
and the config callbacks through which megatron's schedule reaches them (configure_schedule_hooks)."""
from __future__ import annotations

import argparse
import warnings

from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.training import (
    get_megatron_optimizer_config,
    get_optimizer_param_scheduler,
    update_train_iters,
)

from megatron_ext.errors import ConfigError


def build_optimizer(args, model: list):
    config, overrides = get_megatron_optimizer_config(args)
    if args.use_mup:  # megatron's setup_model_and_optimizer (training.py:2119): muP's per-parameter LR and eps
        from megatron.core.optimizer import get_mup_config_overrides
        from megatron.core.utils import get_model_config

        width_mult = get_model_config(model[0]).mup_width_mult
        overrides = {**(overrides or {}), **get_mup_config_overrides(config=config, mup_width_mult=width_mult,
                                                                     optimizer_type=config.optimizer)}
    optimizer = get_megatron_optimizer(config, model, config_overrides=overrides)
    return optimizer, build_scheduler(args, optimizer)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """megatron.training.get_optimizer_param_scheduler on a copy of the flags (it fills in defaults
    such as lr_decay_iters); for sample-based training train_iters, derived at parse time, is
    hidden again so megatron takes its sample branch."""
    from megatron_ext.seams import megatron_training_globals

    view = argparse.Namespace(**vars(args))
    if args.train_samples:
        view.train_iters = None
    with megatron_training_globals(view):
        return get_optimizer_param_scheduler(optimizer)


def logged_learning_rate(optimizer) -> float:
    """The learning rate of the log line: a parameter group that holds parameters, as megatron's
    train_step reads it (training.py); 0 when none does (--freeze-all-layers), as its training_log."""
    for group in optimizer.param_groups:
        if group["params"] and not group.get("is_decoupled_lr", False):
            return group["lr"]
    return 0.0


class _NoOptimizer:
    param_groups = [{}]


def refuse_batch_size_schedules(args) -> None:
    """Before megatron's validate_args (which also rejects a schedule next to --global-batch-size)."""
    if args.rampup_batch_size or args.step_batch_size_schedule:
        flag = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
        raise ConfigError(f"{flag}: batch-size schedules are not supported by this loop (constant --global-batch-size)")


def resolve_iterations(args) -> None:
    """Parse time: --train-iters, or megatron's train_iters from --train-samples (update_train_iters);
    then the schedule megatron would build, so its checks fail before any compute, by flag name."""
    if args.train_iters is None and not args.train_samples:
        raise ConfigError("give --train-iters N or --train-samples N")
    if args.train_samples:
        update_train_iters(args)  # train_samples // global_batch_size, as megatron
        if args.train_iters < 1:
            raise ConfigError(
                f"--train-samples={args.train_samples}: fewer than one --global-batch-size={args.global_batch_size}"
            )
        args.config_sources["train_iters"] = "derived (--train-samples / --global-batch-size)"
    import logging

    quiet = logging.getLogger("megatron.core.optimizer_param_scheduler")
    level, quiet.level = quiet.level, logging.WARNING  # its INFO line belongs to the run, not to parsing
    try:
        with warnings.catch_warnings():  # its log_single_rank warns that no rank is known yet
            warnings.simplefilter("ignore", UserWarning)
            build_scheduler(args, _NoOptimizer())
    except AssertionError:
        unit = "samples" if args.train_samples else "iters"
        warm = (f"--lr-warmup-fraction={args.lr_warmup_fraction}" if args.lr_warmup_fraction is not None
                else f"--lr-warmup-{unit}={getattr(args, 'lr_warmup_' + unit)}")
        decay_dest = "lr_decay_" + unit if getattr(args, "lr_decay_" + unit) else "train_" + unit
        decay = f"--{decay_dest.replace('_', '-')}={getattr(args, decay_dest)}"
        raise ConfigError(
            f"{warm} must be below the decay length {decay} (--lr-decay-{unit}, else --train-{unit}); "
            f"and --min-lr={args.min_lr} <= --lr={args.lr}, --lr-warmup-init={args.lr_warmup_init} <= --lr"
        ) from None
    finally:
        quiet.setLevel(level)


_HOOKED_CONFIGS: list = []  # configs whose callbacks release_schedule_hooks() drops after the run


def configure_schedule_hooks(args, config, model, optimizer) -> None:
    """The config callbacks megatron.training.train() installs (training.py:3530-3550)."""
    _HOOKED_CONFIGS.append(config)
    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in model]
        if args.align_grad_reduce:
            config.grad_sync_func = [m.start_grad_sync for m in model]
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = [m.start_param_sync for m in model]
    for name in ("no_sync_func", "grad_sync_func", "param_sync_func"):
        value = getattr(config, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(config, name, value[0])
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads


def release_schedule_hooks() -> None:
    """Drop the callbacks after the run. They close a reference cycle the garbage collector cannot
    see through: the distributed optimizer's main params are views whose autograd history reaches
    DDP's grad-accumulator hooks (C++), and DDP -> config -> optimizer.scale_loss -> main params.
    Left in place, a process that runs several trainings keeps every model, optimizer and process
    group (with its gloo threads) alive."""
    for config in _HOOKED_CONFIGS:
        for name in ("grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func"):
            setattr(config, name, None)
    _HOOKED_CONFIGS.clear()
