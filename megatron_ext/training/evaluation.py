"""Validation and test, as pretrain_gpt.py runs them: megatron.training's evaluate_and_print_results
(forward-only schedule, eval mode, losses reduced over data-parallel ranks, the ' validation loss at
iteration N | lm loss value: ... | lm loss PPL: ... |' line from the last rank, TensorBoard scalars).

  --eval-interval N      every N iterations, --eval-iters batches of the validation split
  --eval-iters K         (and after training: validation set, then test set; K = 0 turns it off)
  --split / --valid-data-path / --test-data-path / --eval-micro-batch-size / --eval-global-batch-size

The loss is token-weighted over every evaluated micro-batch and data-parallel rank, with --sft too
(megatron's evaluate() would average per-micro-batch means there: sft's around_evaluation hook,
megatron_ext/seams/sft.py).
"""
from __future__ import annotations

import gc
import logging

from megatron.training.training import evaluate_and_print_results

from megatron_ext.training import features, step


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


def after_training(args, iterators, model: list, config, iteration: int, writer=None) -> None:
    """pretrain(): the validation set, then the test set, after the last iteration."""
    if iterators.valid:
        run(args, f"iteration {iteration} on validation set", iterators.valid, model, config, iteration, writer)
    if iterators.test:
        run(args, f"iteration {iteration} on test set", iterators.test, model, config, iteration, writer)
