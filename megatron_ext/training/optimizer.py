"""megatron-core optimizer (distributed optimizer when --use-distributed-optimizer) and LR schedule."""
from __future__ import annotations

from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.training.training import get_megatron_optimizer_config


def build_optimizer(args, model: list):
    config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(config, model, config_overrides=overrides)
    return optimizer, build_scheduler(args, optimizer)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Iteration-based schedule, as megatron.training.get_optimizer_param_scheduler computes it."""
    samples = args.global_batch_size
    decay_steps = (args.lr_decay_iters or args.train_iters) * samples
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_steps
    else:
        warmup_steps = args.lr_warmup_iters * samples
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * samples,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=(args.lr_wsd_decay_iters * samples) if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
