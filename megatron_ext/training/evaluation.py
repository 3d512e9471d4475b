"""Validation and test, as pretrain_gpt.py runs them: megatron.training's evaluate_and_print_results
(forward-only schedule, eval mode, losses reduced over data-parallel ranks, the ' validation loss at
iteration N | lm loss value: ... | lm loss PPL: ... |' line from the last rank, TensorBoard scalars).

  --eval-interval N      every N iterations, --eval-iters batches of the validation split
  --eval-iters K         (and after training: validation set, then test set; K = 0 turns it off)
  --split / --valid-data-path / --test-data-path / --eval-micro-batch-size / --eval-global-batch-size

The loss is token-weighted over every evaluated micro-batch and data-parallel rank, with --sft too
(megatron's evaluate() would average per-micro-batch means there: sft's around_evaluation hook,
megatron_ext/seams/sft.py).

Each line says what it evaluated, after megatron's words: when the last iteration is an
--eval-interval boundary, pretrain() evaluates there and again after training, on the next
--eval-iters batches of the same validation iterator, so two losses of one iteration are printed:

     validation loss at iteration 60 (at --eval-interval 30: validation samples 16-31) | lm loss value: ...
     validation loss at iteration 60 on validation set (after training: validation samples 32-47) | ...
"""
from __future__ import annotations

import gc
import logging

from megatron.training.training import evaluate_and_print_results

from megatron_ext.training import data, features, step


def due(args, iteration: int, iterators) -> bool:
    """megatron's condition: an --eval-interval boundary, a validation split, --start-eval-at-iter passed."""
    return bool(
        args.eval_interval and iteration % args.eval_interval == 0 and iterators.valid
        and (args.start_eval_at_iter is None or iteration >= args.start_eval_at_iter)
    )


def run(args, prefix: str, iterators: list, model: list, config, iteration: int, writer=None) -> None:
    """One evaluation over `iterators` (one per model chunk); prints megatron's line on the last rank."""
    from megatron_ext.seams import megatron_training_globals

    if args.manual_gc and args.manual_gc_eval:
        gc.collect()
    args.consumed_train_samples = iteration * args.global_batch_size  # its "vs samples" TensorBoard axis
    timers = config.timers  # evaluate() leaves megatron's global timers on the config
    # evaluate() switches result validation off and back on, with a warning from every rank each time
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)
    with megatron_training_globals(args, tensorboard_writer=writer), features.around_evaluation(args):
        evaluate_and_print_results(
            prefix, step.forward_step, iterators if len(iterators) > 1 else iterators[0], model, iteration,
            None, config, verbose=False, write_to_tensorboard=writer is not None,
        )
    config.timers = timers
    if args.manual_gc and args.manual_gc_eval:
        gc.collect()


def _samples(args, first: int) -> str:
    """The samples one evaluation reads (--eval-iters batches of --eval-global-batch-size), counted
    along its split as megatron's sampler hands them out: ``32-47``."""
    return f"{first}-{first + args.eval_iters * args.eval_global_batch_size - 1}"


def at_interval(args, iterators, model: list, config, iteration: int, writer=None) -> None:
    """The evaluation of an --eval-interval boundary: the next --eval-iters batches of the validation split."""
    read = data.consumed_valid_samples(args, iteration)  # this evaluation's included
    first = read - args.eval_iters * args.eval_global_batch_size
    run(args, f"iteration {iteration} (at --eval-interval {args.eval_interval}: validation samples "
              f"{_samples(args, first)})", iterators.valid, model, config, iteration, writer)


def after_training(args, iterators, model: list, config, iteration: int, writer=None) -> None:
    """pretrain(): the validation set, then the test set, after the last iteration. The validation
    iterator goes on where the last --eval-interval evaluation left it: at a boundary, the same
    iteration's second line is other samples."""
    if iterators.valid:
        first = data.consumed_valid_samples(args, iteration)
        run(args, f"iteration {iteration} on validation set (after training: validation samples "
                  f"{_samples(args, first)})", iterators.valid, model, config, iteration, writer)
    if iterators.test:
        run(args, f"iteration {iteration} on test set (after training: test samples {_samples(args, 0)})",
            iterators.test, model, config, iteration, writer)
