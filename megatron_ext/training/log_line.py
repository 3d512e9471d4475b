"""Megatron's per-iteration log line, plus tokens/s, TFLOP/s, MFU and peak memory; TensorBoard when
installed, W&B with --wandb-project (megatron's writer). Printed by the last rank (where the loss
lives), as megatron's print_rank_last does. As megatron.training.training_log: the MoE auxiliary
losses (load_balancing_loss, z_loss, ...) and MTP losses join the line, --moe-per-layer-logging
writes them per layer to TensorBoard/W&B, --log-throughput adds 'throughput per GPU (TFLOP/s/GPU)'."""
from __future__ import annotations

import math
import time

import torch
from megatron.core.utils import to_local_if_dtensor
from megatron.training.training import num_floating_point_operations

from megatron_ext import platform
from megatron_ext.errors import ConfigError


def validate(args) -> None:
    """W&B as megatron sets it up (global_vars._set_wandb_writer): refused by name where it would fail."""
    if not args.wandb_project:
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb-project={args.wandb_project}: the wandb package is not installed")
    if not args.wandb_exp_name:
        raise ConfigError(f"--wandb-project={args.wandb_project} needs --wandb-exp-name")
    if not args.wandb_save_dir and not args.save:
        raise ConfigError(f"--wandb-project={args.wandb_project} needs --wandb-save-dir or --save")

# Dense bf16 peak of one GPU, for MFU. Unknown devices report MFU as n/a rather than a guess.
PEAK_TFLOPS_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


def peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS_BF16.items() if k in name), None)


def peak_memory_gib() -> tuple[float, float] | None:
    """(peak allocated, peak reserved) on the GPU; on CPU the process's peak RSS as both."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return rss, rss


def state_bytes(model: list, optimizer) -> dict:
    """This rank's bytes of parameters, gradients and optimizer state, each storage counted once:
    parameters = the storages the model's parameters live in (DDP's buffers; Megatron-FSDP's
    persistent weight and main-weight buffers, its shards under optim_grads_params, padding
    included) and separate main (fp32) parameter copies; gradients = the gradient buffers
    (DDP's grad buffers, Megatron-FSDP's main-grad buffers); optimizer state = every tensor of the
    optimizer's per-parameter state (Adam's moments, its step)."""
    seen: set = set()

    def add(t) -> int:
        if t is None or not torch.is_tensor(t):
            return 0
        storage = to_local_if_dtensor(t).untyped_storage()  # a DTensor: this rank's shard
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    params = grads = optim = 0
    for chunk in model:
        fsdp = getattr(chunk, "param_and_grad_buffer", None)
        if fsdp is None:  # Megatron-FSDP's module parameters are views of its shards (counted below)
            params += sum(add(p) for p in chunk.parameters())  # or of its unsharded buckets (in flight)
        for group in getattr(fsdp, "parameter_groups", []) or []:  # Megatron-FSDP
            for buf in (group.model_weight_buffer, group.main_weight_buffer):
                params += add(getattr(buf, "data", None))
            grads += add(getattr(group.main_grad_buffer, "data", None))
        ddp = [] if fsdp is not None else _ddp_buffers(chunk)
        for buf in ddp:
            params += add(buf.param_data)
            grads += add(buf.grad_data)
        if fsdp is None and not ddp:  # torch FSDP2: each DTensor parameter holds its gradient's shard
            grads += sum(add(p.grad) for p in chunk.parameters())
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        params += sum(add(p) for group in inner.param_groups for p in group["params"])  # main params
        optim += sum(add(v) for state in inner.state.values() for v in state.values())
    return {"param bytes": params, "grad bytes": grads, "optim bytes": optim}


def _ddp_buffers(chunk) -> list:
    """megatron-core DDP's parameter-and-gradient buffers (a module's `buffers` is a method elsewhere)."""
    dense = getattr(chunk, "buffers", [])
    return (dense if isinstance(dense, list) else []) + list(getattr(chunk, "expert_parallel_buffers", None) or [])


def params_norm(args, model: list) -> float:
    """--log-params-norm: megatron's calc_params_l2_norm (DDP's buffers or Megatron-FSDP's DTensor
    shards, reduced over their groups), which reads megatron.training's global args."""
    from megatron.training.utils.common_utils import calc_params_l2_norm

    from megatron_ext.seams import megatron_training_globals

    with megatron_training_globals(args):
        return float(calc_params_l2_norm(model))


_MEMORY_KEYS = ("param bytes", "grad bytes", "optim bytes", "fsdp unsharded bytes", "fsdp unsharded peak bytes")


class TrainingLogger:
    def __init__(self, args, model: list | None = None, optimizer=None, capabilities=None):
        """``capabilities``: what at_log_line() and log_counters() are called on at each line (the
        run hands in megatron_ext/training/features.py)."""
        self.args = args
        self.capabilities = capabilities
        self.model, self.optimizer = model, optimizer  # for the per-rank state bytes
        self.is_logging_rank = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1
        self.last = self.interval_start = time.perf_counter()
        self.interval_iterations = 0
        self.skipped = 0
        self.nan_iterations = 0
        self.writer = self._tensorboard(args) if self.is_logging_rank else None
        self.wandb = self._wandb(args)
        self._records: list[dict] = []
        self._unread = 0  # trailing records whose loss is still a device tensor

    @staticmethod
    def _tensorboard(args):
        if not args.tensorboard_dir:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("tensorboard is not installed: --tensorboard-dir ignored for logging", flush=True)
            return None
        return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)

    @staticmethod
    def _wandb(args):
        if not args.wandb_project:
            return None
        from megatron.training import global_vars as gv

        gv._set_wandb_writer(args)  # the last rank's wandb run (None elsewhere)
        return gv.get_wandb_writer()

    def _model_losses(self, iteration: int) -> dict:
        """megatron's MoE tracker report and MTP metrics (every rank takes part in their reductions)."""
        args, losses = self.args, {}
        num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
        if args.num_experts is not None:
            from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

            names = [n for key, n in (("aux_loss", "load_balancing_loss"), ("seq_aux_loss", "seq_load_balancing_loss"),
                                      ("global_aux_loss", "global_load_balancing_loss"))
                     if key in args.moe_router_load_balancing_type]
            if args.moe_z_loss_coeff is not None:
                names.append("z_loss")
            get_moe_metrics_tracker().report(
                loss_scale=1 / num_microbatches, iteration=iteration, writer=self.writer, wandb_writer=self.wandb,
                per_layer_logging=args.moe_per_layer_logging, force_initialize=True, track_names=names,
                num_layers=args.num_layers, moe_layer_freq=args.moe_layer_freq, mtp_num_layers=args.mtp_num_layers,
                total_loss_dict=losses,
            )
        if args.mtp_num_layers is not None:
            from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

            MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches, iteration, self.writer, self.wandb, losses)
        return {k: float(v) for k, v in losses.items()}

    def log(self, iteration: int, result, lr: float, extra: dict | None = None) -> dict:
        """Called every iteration; prints every --log-interval. Returns this iteration's record."""
        args = self.args
        extra = {**self._model_losses(iteration), **(extra or {})}
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        if not result.update_successful:
            self.skipped += 1
        record = {
            "iteration": iteration,
            "lm loss": result.lm_loss.detach(),  # read on the host only when a line is printed
            "grad norm": None if result.grad_norm is None else float(result.grad_norm),
            "learning rate": lr,
            **self._rates(elapsed),
            **(extra or {}),
        }
        if args.log_num_zeros_in_grad and result.num_zeros is not None:
            record["num zeros"] = int(result.num_zeros)
        self._records.append(record)
        self._unread += 1
        self.interval_iterations += 1
        line_due = iteration % args.log_interval == 0 or iteration == args.train_iters
        if line_due:
            if self.capabilities is not None:
                self.capabilities.at_log_line(args)  # every rank
            record.update(self._memory())
            if args.log_params_norm and self.model is not None:  # a collective: every rank
                record["params norm"] = params_norm(args, self.model)
        if self.is_logging_rank and line_due:
            self._read_losses()
            # like Megatron, time and throughput averaged over the iterations since the last line
            per_iteration = (now - self.interval_start) / self.interval_iterations
            counters = self.capabilities.log_counters() if self.capabilities is not None else {}
            shown = dict(record, **self._rates(per_iteration), **counters)
            print(self.format(shown), flush=True)
            scalars = {k: v for k, v in shown.items() if isinstance(v, (int, float)) and k != "iteration"}
            if self.writer is not None:
                for key, value in scalars.items():
                    self.writer.add_scalar(key, value, iteration)
                self._write_megatron_scalars(shown, iteration)
            if self.wandb is not None:
                self.wandb.log(scalars, iteration)
            self.interval_start, self.interval_iterations = now, 0
        return record

    def _write_megatron_scalars(self, shown: dict, iteration: int) -> None:
        """--log-timers-to-tensorboard and --log-memory-to-tensorboard as megatron's training_log
        writes them (training.py:2741-2752, 2839-2861): the iteration time, the throughput, and the
        CUDA caching allocator's statistics. Megatron's per-phase timers are not kept by this loop."""
        args, writer = self.args, self.writer
        if args.log_timers_to_tensorboard:
            writer.add_scalar("iteration-time", shown["elapsed ms"] / 1e3, iteration)
            if args.log_throughput:
                writer.add_scalar("throughput", shown["TFLOP/s/GPU"], iteration)
        if args.log_memory_to_tensorboard and torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            writer.add_scalar("mem-reserved-bytes", stats["reserved_bytes.all.current"], iteration)
            writer.add_scalar("mem-allocated-bytes", stats["allocated_bytes.all.current"], iteration)
            writer.add_scalar("mem-max-allocated-bytes", stats["allocated_bytes.all.peak"], iteration)
            writer.add_scalar("mem-allocated-count", stats["allocation.all.current"], iteration)

    def _memory(self) -> dict:
        """Per-rank state bytes; with Megatron-FSDP also the peak of its unsharded buckets (the layers
        in flight) since the last line."""
        if self.model is None:
            return {}
        out = state_bytes(self.model, self.optimizer)
        if self.args.use_megatron_fsdp:
            from megatron_ext.seams.fsdp import InFlight

            out["fsdp unsharded bytes"] = InFlight.now
            out["fsdp unsharded peak bytes"] = InFlight.peak
            InFlight.reset_peak()
        return out

    def close(self) -> None:
        """Flush and stop the TensorBoard writer (its background thread and file); finish the W&B run."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            from megatron.training import global_vars as gv

            self.wandb.finish()
            self.wandb = gv._GLOBAL_WANDB_WRITER = None

    def _read_losses(self) -> None:
        """One host read per log line (not per iteration) for the losses since the last line."""
        pending = self._records[len(self._records) - self._unread:]
        if pending:
            values = torch.stack([r["lm loss"].float().cpu() for r in pending]).tolist()
            for record, value in zip(pending, values):
                record["lm loss"] = value
                if self.is_logging_rank and not math.isfinite(value):
                    self.nan_iterations += 1
        self._unread = 0

    @property
    def history(self) -> list[dict]:
        """Every iteration's record, losses as floats."""
        self._read_losses()
        return self._records

    def _rates(self, seconds: float) -> dict:
        args = self.args
        flops = num_floating_point_operations(args, args.global_batch_size)
        return {
            "elapsed ms": seconds * 1e3,
            "tokens/s": args.global_batch_size * args.seq_length / seconds,
            "TFLOP/s/GPU": flops / seconds / 1e12 / args.world_size,
        }

    def format(self, r: dict) -> str:
        args = self.args
        parts = [
            f" iteration {r['iteration']:8d}/{args.train_iters:8d}",
            f"consumed samples: {r['iteration'] * args.global_batch_size:12d}",
            f"elapsed time per iteration (ms): {r['elapsed ms']:.1f}",
            *([f"throughput per GPU (TFLOP/s/GPU): {r['TFLOP/s/GPU']:.1f}"] if args.log_throughput else []),
            f"learning rate: {r['learning rate']:.6E}",
            f"global batch size: {args.global_batch_size:5d}",
            f"lm loss: {r['lm loss']:.6E}",
        ]
        if r["grad norm"] is not None:
            parts.append(f"grad norm: {r['grad norm']:.3f}")
        if "num zeros" in r:
            parts.append(f"num zeros: {r['num zeros']}")
        if "params norm" in r:
            parts.append(f"params norm: {r['params norm']:.3f}")
        parts += [
            f"number of skipped iterations: {self.skipped:3d}",
            f"number of nan iterations: {self.nan_iterations:3d}",
            f"tokens/s: {r['tokens/s']:.0f}",
            f"TFLOP/s/GPU: {r['TFLOP/s/GPU']:.3f}",
        ]
        peak = peak_tflops()
        parts.append(f"MFU: {100 * r['TFLOP/s/GPU'] / peak:.1f}%" if peak else "MFU: n/a")
        mem = peak_memory_gib()
        label = "peak alloc/reserved (GiB)" if platform.current().is_cuda else "peak RSS (GiB)"
        parts.append(f"{label}: {mem[0]:.2f}/{mem[1]:.2f}" if platform.current().is_cuda else f"{label}: {mem[0]:.2f}")
        if "param bytes" in r:
            mib = [r[k] / 2**20 for k in _MEMORY_KEYS[:3]]
            parts.append("params/grads/optim state per rank (MiB): " + "/".join(f"{v:.2f}" for v in mib))
            if "fsdp unsharded peak bytes" in r:  # the gathered layers: now (between steps) / peak
                parts.append("FSDP unsharded now/peak (MiB): "
                             f"{r['fsdp unsharded bytes'] / 2**20:.2f}/{r['fsdp unsharded peak bytes'] / 2**20:.2f}")
        for key, value in r.items():
            if key not in _CORE_KEYS and key not in _MEMORY_KEYS:
                parts.append(f"{key}: {value:.6E}" if key.endswith("loss") else f"{key}: {value}")
        return " | ".join(parts) + " |"


_CORE_KEYS = {"iteration", "lm loss", "grad norm", "learning rate", "elapsed ms", "tokens/s", "TFLOP/s/GPU",
              "num zeros", "params norm"}
