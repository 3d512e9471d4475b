"""Per-step observability around the loop: a torch.profiler trace and a CUDA memory snapshot for a
chosen step range, and non-finite loss detection without a host sync of its own.

Megatron's flags, with megatron's meanings (megatron/training/training.py:3660-3740, :3195-3210):
  --profile --use-pytorch-profiler     torch.profiler trace; --profile alone: nsys capture range
                                       (cudaProfilerStart/Stop), CUDA only
  --profile-step-start S --profile-step-end E
                                       the iterations logged S+1 .. E (S, E count completed iterations)
  --profile-ranks R ...                ranks that profile (default: all, as megatron)
  --record-memory-history              CUDA allocator history over the same step range, dumped to
  --memory-snapshot-path P             P (rank-suffixed when several ranks record); default rank:
                                       the last one, as megatron
  --no-check-for-nan-in-loss-and-grad  turn the non-finite check off (it is on by default)
The trace goes to <--tensorboard-dir>/../torch_profile/rank-<r>.json.gz (megatron's place), or
./torch_profile/ without --tensorboard-dir.
"""
from __future__ import annotations

import math
import os

import torch
from megatron.core import parallel_state

from megatron_ext import platform
from megatron_ext.errors import ConfigError
from megatron_ext.platform.target import resolve


def validate(args) -> None:
    if args.profile and args.profile_step_end <= args.profile_step_start:
        raise ConfigError(
            f"--profile-step-end={args.profile_step_end}: must be above --profile-step-start={args.profile_step_start}"
        )
    if args.profile and not args.use_pytorch_profiler and not resolve(args).cuda:  # this machine or the --platform target
        raise ConfigError(
            "--profile without --use-pytorch-profiler is an nsys capture range (cudaProfilerStart/Stop), "
            "CUDA only: add --use-pytorch-profiler for a torch.profiler trace"
        )


def trace_dir(args) -> str:
    if args.tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(args.tensorboard_dir)), "torch_profile")
    return "torch_profile"


class StepRange:
    """Starts the profiler / memory history before iteration S+1, stops them after iteration E."""

    def __init__(self, args):
        self.args = args
        self.rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        self.first, self.last = args.profile_step_start + 1, args.profile_step_end
        selected = (not args.profile_ranks) or self.rank in args.profile_ranks
        self.profile = args.profile and selected
        memory_ranks = args.profile_ranks or [world - 1]
        self.memory = args.record_memory_history and self.rank in memory_ranks
        self.memory_suffix = len(memory_ranks) > 1
        if self.memory and not platform.current().is_cuda:
            if self.rank == memory_ranks[0]:
                print("--record-memory-history: the CUDA allocator history needs a GPU; not recorded on CPU", flush=True)
            self.memory = False
        self.prof = None
        self.label = None
        self.trace_path = None

    def before_step(self, iteration: int) -> None:
        if iteration == self.first:
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            if self.profile:
                self._start_profiler()
        if self.prof is not None:
            self.label = torch.profiler.record_function(f"iteration_{iteration}")
            self.label.__enter__()

    def after_step(self, iteration: int) -> None:
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if self.prof is not None:
            self.prof.step()
        if iteration == self.last:
            self.close()

    def close(self) -> None:
        if self.label is not None:
            self.label.__exit__(None, None, None)
            self.label = None
        if self.prof is not None:
            if self.args.use_pytorch_profiler:
                self.prof.stop()
                os.makedirs(trace_dir(self.args), exist_ok=True)
                self.trace_path = os.path.join(trace_dir(self.args), f"rank-{self.rank}.json.gz")
                self.prof.export_chrome_trace(self.trace_path)
            else:
                self.prof.__exit__(None, None, None)
                torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.prof = None
        if self.memory:
            path = self.args.memory_snapshot_path
            if self.memory_suffix:
                root, ext = os.path.splitext(path)
                path = f"{root}.rank{self.rank}{ext}"
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.memory = False

    def _start_profiler(self) -> None:
        args = self.args
        if args.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if platform.current().is_cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                record_shapes=args.pytorch_profiler_collect_shapes,
                with_stack=args.pytorch_profiler_collect_callstack,
            )
            self.prof.start()
        else:  # nsys: capture range plus NVTX ranges, as megatron
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.prof = torch.autograd.profiler.emit_nvtx(record_shapes=args.pytorch_profiler_collect_shapes)
            self.prof.__enter__()
            self.prof.step = lambda: None


class NonFiniteLoss(FloatingPointError):
    pass


class NonFiniteCheck:
    """Detects a NaN/Inf loss or grad norm without a host sync of its own: each iteration folds
    `isfinite(loss)` into a flag that stays on the device (with the first bad iteration); every
    --log-interval one MAX all-reduce over all ranks brings it to the host, and every rank raises
    NonFiniteLoss naming the iteration. On the GPU the per-step work is two small kernels."""

    def __init__(self, args):
        self.enabled = args.check_for_nan_in_loss_and_grad
        self.interval = args.log_interval
        self.device = platform.current().device
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.first_bad = torch.zeros((), dtype=torch.int64, device=self.device)  # 0: none yet
        self.host_checks = 0  # collectives issued (tests count them)

    def after_step(self, iteration: int, result) -> None:
        if not self.enabled:
            return
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        if self.last_stage:
            bad = ~torch.isfinite(result.lm_loss.detach().to(self.device))
        if result.grad_norm is not None and not math.isfinite(float(result.grad_norm)):  # already on host
            bad = torch.ones((), dtype=torch.bool, device=self.device)
        first = torch.where(bad & (self.first_bad == 0), iteration, self.first_bad)
        self.first_bad = first
        if iteration % self.interval == 0:
            self.check()

    def check(self) -> None:
        if not self.enabled:
            return
        flag = self.first_bad.clone()
        # the smallest non-zero iteration across ranks: MIN over "no failure" mapped to a large value
        flag = torch.where(flag == 0, torch.iinfo(torch.int64).max, flag)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        self.host_checks += 1
        first = int(flag)
        if first != torch.iinfo(torch.int64).max:
            raise NonFiniteLoss(
                f"non-finite loss or grad norm at iteration {first} (checked every --log-interval="
                f"{self.interval}; --no-check-for-nan-in-loss-and-grad turns the check off)"
            )


class ZeroGradAfterResume:
    """A resumed run whose grad norm is exactly 0 in every iteration up to its first log line
    learns nothing: typically weights that were saved zeroed, which no checksum can tell from good
    ones (non-finite ones the check above catches). Warned once, on rank 0; the grad norm is
    already on the host and the same on every rank, so this costs no sync. The first iteration
    tells a resume (it follows the loaded checkpoint's)."""

    def __init__(self, args):
        self.interval = args.log_interval
        self.first = None
        self.all_zero = True
        self.rank = torch.distributed.get_rank()
        self.warned = False
        self.done = args.freeze_all_layers  # nothing trains, by request: a zero grad norm is expected

    def after_step(self, iteration: int, result) -> None:
        if self.done:
            return
        if self.first is None:
            self.first = iteration
            if iteration == 1:  # a fresh start, not a resume
                self.done = True
                return
        norm = result.grad_norm
        self.all_zero = self.all_zero and norm is not None and float(norm) == 0.0
        if iteration % self.interval == 0:
            self.done = True
            self.warned = self.all_zero
            if self.all_zero and self.rank == 0:
                span = f"iteration {iteration}" if iteration == self.first else f"iterations {self.first}-{iteration}"
                print(
                    f"warning: grad norm exactly 0 in {span} after resuming from iteration {self.first - 1}: "
                    "the loaded weights may be zeroed (or every parameter frozen); nothing is being learned",
                    flush=True,
                )


class Observer:
    """What the loop calls: before_step(i), after_step(i, result), close()."""

    def __init__(self, args):
        self.steps = StepRange(args)
        self.nonfinite = NonFiniteCheck(args)
        self.zero_grad = ZeroGradAfterResume(args)

    def before_step(self, iteration: int) -> None:
        self.steps.before_step(iteration)

    def after_step(self, iteration: int, result) -> None:
        self.steps.after_step(iteration)
        self.nonfinite.after_step(iteration, result)
        self.zero_grad.after_step(iteration, result)

    def close(self) -> None:
        self.steps.close()
        self.nonfinite.check()
