"""When the loop stops early, and Python's garbage collector, as megatron.training.train does it.

  SIGINT, SIGTERM              (Ctrl-C; torchrun's agent passes either on to every rank; a scheduler's
                               preemption) recorded, never raised: every rank stops at the next step
                               boundary, saves when --save is given, and rank 0 prints one line: the
                               iteration, the checkpoint and the command that resumes
  --exit-signal-handler        also --exit-signal (default SIGTERM), as megatron's
                               DistributedSignalHandler
  --exit-interval N            after iteration N (and multiples)
  --exit-duration-in-mins M    once any rank has run M minutes since the program started
                               (megatron's _TRAIN_START_TIME; train.py registers its own start)
  --manual-gc [--manual-gc-interval N] [--no-manual-gc-eval]
                               automatic gc off for the run; gc.collect() every N iterations
                               (and around evaluations); the previous gc state restored after

Each condition is agreed across ranks (all-reduce) so every rank stops at the same iteration, with
no collective left half-done; the loop then saves a checkpoint when --save is given
(Checkpointer.close). A received signal is agreed on at every step boundary by an all-reduce of a
host flag over gloo (the default group on CPU, a gloo group of the world on CUDA: no device sync),
as megatron's DistributedSignalHandler all-gathers its flags. The handlers stay installed until the
save and the line are done (a launcher may pass the signal on a second time), then the previous ones
come back.
"""
from __future__ import annotations

import gc
import os
import shlex
import signal
import sys
import threading
import time

import torch

from megatron_ext import platform

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """Signals recorded instead of raised, and the ranks' agreement on whether any rank got one."""

    def __init__(self, signals):
        self.received: int | None = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            for sig in dict.fromkeys(signals):
                self._previous[sig] = signal.signal(sig, self._record)
        dist = torch.distributed
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def _record(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signum

    def agreed(self) -> int | None:
        """The signal any rank received (the highest number), or None: every rank calls it."""
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag.item()) or None

    def release(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self.group is not None:
            torch.distributed.destroy_process_group(self.group)
            self.group = None


class ExitConditions:
    def __init__(self, args):
        self.args = args
        self.reason: str | None = None
        self.signal: int | None = None
        extra = (signal.Signals(int(args.exit_signal)),) if args.exit_signal_handler else ()
        self.interrupts = Interrupts((*STOP_SIGNALS, *extra))
        self.gc_was_enabled = gc.isenabled()
        if args.manual_gc:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> bool:
        """True when the loop must stop after this iteration (self.reason says why)."""
        args = self.args
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        self.signal = self.interrupts.agreed()
        if self.signal is not None:
            self.reason = f"interrupted by {signal.Signals(self.signal).name} after iteration {iteration}"
            return True  # the line comes after the save (interrupted)
        if args.exit_duration_in_mins and self._duration_reached():
            self.reason = f"exiting program after {args.exit_duration_in_mins} minutes"
        elif args.exit_interval and iteration % args.exit_interval == 0:
            self.reason = f"exiting program at iteration {iteration}"
        if self.reason and torch.distributed.get_rank() == 0:
            print(self.reason, flush=True)
        return self.reason is not None

    def interrupted(self, iteration: int, saved: str | None, argv: list[str] | None) -> None:
        """After a signal stopped the loop and the checkpoint is written: rank 0's one line."""
        if self.signal is None or torch.distributed.get_rank() != 0:
            return
        name = signal.Signals(self.signal).name
        if saved is None:
            print(f"[interrupted] {name}: stopped after iteration {iteration}; nothing saved (no --save)", flush=True)
            return
        print(f"[interrupted] {name}: stopped after iteration {iteration}, saved {saved}; resume with: "
              f"{resume_command(argv, self.args.save)}", flush=True)

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
        if self.interrupts is not None:
            self.interrupts.release()
            self.interrupts = None
        if self.args.manual_gc and self.gc_was_enabled:
            gc.enable()


def resume_command(argv: list[str] | None, save: str, env=os.environ) -> str:
    """The command that resumes this run from --save: its launch and arguments, --load pointing at
    --save (any other --load, and --finetune, dropped)."""
    kept, skip = [], False
    for arg in list(sys.argv[1:] if argv is None else argv):
        if skip:
            skip = False
        elif arg == "--load":
            skip = True
        elif not arg.startswith("--load=") and arg != "--finetune":
            kept.append(arg)
    script = sys.argv[0] if os.path.basename(sys.argv[0]) == "train.py" else "train.py"
    per_node, world = env.get("LOCAL_WORLD_SIZE"), int(env.get("WORLD_SIZE", "1"))
    if per_node is None:
        launch = ["python"]
    elif world > int(per_node):
        launch = ["torchrun", "--nnodes", str(world // int(per_node)), "--nproc-per-node", per_node,
                  "<this job's rendezvous flags>"]
    else:
        launch = ["torchrun", "--nproc-per-node", per_node]
    return " ".join([*launch, *map(shlex.quote, [script, *kept, "--load", save])])
