"""Train a GPT (dense or MoE) with megatron-core.

    torchrun --nproc-per-node N train.py --recipe recipes/tiny_dense.yaml [--any-megatron-flag value]
"""
from __future__ import annotations

import logging

from megatron_ext import platform


def main(argv: list[str] | None = None) -> list[dict]:
    platform.setup()  # CPU shims or this rank's GPU, before megatron-core is imported
    import arguments

    args = arguments.parse(argv)  # every check happens here; --dry-run exits here
    platform.init_distributed(args.distributed_timeout_minutes * 60)
    logging.getLogger("megatron").setLevel(args.logging_level or logging.WARNING)

    from megatron_ext import schedules
    from megatron_ext.training import checkpointing, data, model as models, observability, optimizer as optim
    from megatron_ext.training import parallel, run, step
    from megatron_ext.training.log_line import TrainingLogger

    run.initialize_parallel(args)
    logger = None
    try:
        config = models.transformer_config(args)
        model = models.build_model(args, config)
        optimizer, scheduler = optim.build_optimizer(args, model)
        step.configure_schedule_hooks(args, config, model, optimizer)
        ckpt = checkpointing.Checkpointer(args, model, optimizer, scheduler)
        start = iteration = ckpt.load()  # newest complete checkpoint under --load, else 0
        iterators = data.build_train_iterators(args, len(model), consumed_samples=start * args.global_batch_size)
        ckpt.restore_rng()  # after the iterators: building them draws from the CPU generator
        forward_backward = schedules.get_forward_backward_func(args)  # megatron's, or our TP-overlap 1F1B
        logger = TrainingLogger(args)
        observer = observability.Observer(args)  # profiler/memory step range, non-finite loss check

        for iteration in range(start + 1, args.train_iters + 1):
            observer.before_step(iteration)
            result = step.train_step(args, model, optimizer, scheduler, iterators, forward_backward)
            logger.log(iteration, result, lr=optimizer.param_groups[0]["lr"])
            observer.after_step(iteration, result)
            ckpt.after_step(iteration)  # saves every --save-interval
            if args.exit_interval and iteration % args.exit_interval == 0:
                break
        observer.close()
        ckpt.close(iteration)  # saves at exit, waits for async saves
        return logger.history
    finally:
        if logger is not None:
            logger.close()  # on every exit path: the TensorBoard writer owns a thread
        parallel.destroy()


if __name__ == "__main__":
    from megatron_ext import errors

    platform.setup()
    import arguments

    errors.run(main, explain=arguments.explain)  # a refused flag: one line on rank 0, exit 1
