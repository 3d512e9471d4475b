"""When the loop stops early, and Python's garbage collector, as megatron.training.train does it.

  --exit-interval N            after iteration N (and multiples)
  --exit-duration-in-mins M    once any rank has run M minutes since the program started
                               (megatron's _TRAIN_START_TIME; train.py registers its own start)
  --exit-signal-handler        on --exit-signal (SIGTERM) received by any rank: megatron's
                               DistributedSignalHandler, restored when the run ends
  --manual-gc [--manual-gc-interval N] [--no-manual-gc-eval]
                               automatic gc off for the run; gc.collect() every N iterations
                               (and around evaluations); the previous gc state restored after

Each condition is agreed across ranks (all-reduce / all-gather) so every rank stops at the same
iteration; the loop then saves a checkpoint when --save is given (Checkpointer.close).
"""
from __future__ import annotations

import gc
import time

import torch

from megatron_ext import platform


class ExitConditions:
    def __init__(self, args):
        self.args = args
        self.reason: str | None = None
        self.handler = None
        if args.exit_signal_handler:
            from megatron.training.dist_signal_handler import DistributedSignalHandler

            self.handler = DistributedSignalHandler(args.exit_signal).__enter__()
        self.gc_was_enabled = gc.isenabled()
        if args.manual_gc:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> bool:
        """True when the loop must stop after this iteration (self.reason says why)."""
        args = self.args
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        if self.handler is not None and any(self.handler.signals_received()):
            self.reason = f"exiting program after receiving signal {int(args.exit_signal)}"
        elif args.exit_duration_in_mins and self._duration_reached():
            self.reason = f"exiting program after {args.exit_duration_in_mins} minutes"
        elif args.exit_interval and iteration % args.exit_interval == 0:
            self.reason = f"exiting program at iteration {iteration}"
        if self.reason and torch.distributed.get_rank() == 0:
            print(self.reason, flush=True)
        return self.reason is not None

    def _duration_reached(self) -> bool:
        from megatron.training import training

        minutes = (time.time() - training._TRAIN_START_TIME) / 60.0
        done = torch.tensor([minutes > self.args.exit_duration_in_mins], dtype=torch.int, device=platform.current().device)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        return bool(done.item())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        if self.handler is not None:
            self.handler.release()
            self.handler = None
        if self.args.manual_gc and self.gc_was_enabled:
            gc.enable()
