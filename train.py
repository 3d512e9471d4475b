"""Train a GPT (dense or MoE) with megatron-core.

    torchrun --nproc-per-node N train.py --recipe recipes/tiny_dense.yaml [--any-megatron-flag value]
"""
from __future__ import annotations

import logging
import sys
import time

PROGRAM_START = time.time()  # --exit-duration-in-mins counts from here, as pretrain_gpt.py's

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    from megatron_ext import helptext  # a cached text: --help imports neither torch nor megatron-core

    def _render_help() -> str:
        from megatron_ext import platform

        platform.setup()  # before megatron-core is imported
        from megatron_ext import arguments

        return arguments.build_parser().format_help()

    helptext.show("train", __file__, _render_help)

from megatron_ext import platform  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    platform.setup()  # CPU shims or this rank's GPU, before megatron-core is imported
    from megatron_ext import arguments

    if "--plan" in (sys.argv[1:] if argv is None else argv):  # predict memory and step time instead
        from megatron_ext import planner

        return planner.main(argv, prefix="--plan-", parse=arguments.parse)

    args = arguments.parse(argv)  # every check happens here; --dry-run exits here
    platform.init_distributed(args.distributed_timeout_minutes * 60)
    logging.getLogger("megatron").setLevel(args.logging_level or logging.WARNING)

    from megatron_ext import schedules
    from megatron_ext.training import checkpointing, data, evaluation, exits, model as models, observability
    from megatron_ext.training import optimizer as optim, parallel, run, step
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
        iterators = data.build_iterators(args, len(model), iteration=start)  # train, valid, test
        ckpt.restore_rng()  # after the iterators: building them draws from the CPU generator
        forward_backward = schedules.get_forward_backward_func(args)  # megatron's, or our TP-overlap 1F1B
        logger = TrainingLogger(args, model, optimizer)  # model, optimizer: the per-rank state bytes
        observer = observability.Observer(args)  # profiler/memory step range, non-finite loss check
        with exits.ExitConditions(args) as stop:  # exit interval/duration/signal, manual gc
            last = start if args.skip_train else args.train_iters
            for iteration in range(start + 1, last + 1):
                observer.before_step(iteration)
                result = step.train_step(args, model, optimizer, scheduler, iterators.train, forward_backward)
                models.register_fsdp_buffers(args, model, iteration - start)  # --use-nccl-ub, after the first
                logger.log(iteration, result, lr=optim.logged_learning_rate(optimizer))
                observer.after_step(iteration, result)
                if evaluation.due(args, iteration, iterators):
                    evaluation.run(args, f"iteration {iteration}", iterators.valid, model, config, iteration,
                                   logger.writer)
                ckpt.after_step(iteration)  # saves every --save-interval
                if stop.after_step(iteration):
                    break
        observer.close()
        ckpt.close(iteration)  # saves at exit, waits for async saves
        if not stop.reason:
            evaluation.after_training(args, iterators, model, config, iteration, logger.writer)
        return logger.history
    finally:
        if logger is not None:
            logger.close()  # on every exit path: the TensorBoard writer owns a thread (and W&B's run)
        parallel.destroy()


if __name__ == "__main__":
    from megatron_ext import errors

    errors.quiet()  # third-party warnings that tell the user nothing (--verbose shows them)
    platform.dump_native_crashes()  # a native crash prints every thread's Python stack, prefixed [rank<R>]:
    platform.setup()
    from megatron_ext import arguments
    from megatron.training.training import set_startup_timestamps

    set_startup_timestamps(program_start=PROGRAM_START)
    errors.run(main, explain=arguments.explain)  # a refused flag: one line on rank 0, exit 1
