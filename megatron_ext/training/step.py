"""One training iteration: megatron-core's pipeline schedule, then the optimizer step."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from megatron_ext import platform
from megatron_ext.training import features


@dataclass
class StepResult:
    lm_loss: torch.Tensor  # averaged over micro-batches and data-parallel ranks (last stage only)
    grad_norm: float | None
    num_zeros: int | None
    update_successful: bool


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """pretrain_gpt.py's forward step. A batch a package's data made comes as that package says
    (features.py batch_inputs: --sft's packed rows bring their per-conversation attention, a mask on
    the local spec, PackedSeqParams (THD) on transformer-engine's). With ``return_schedule_plan`` (asked
    by megatron's combined 1F1B, --overlap-moe-expert-parallel-comm, combined_1f1b.py:384) the model's
    schedule plan (GPTModel.build_schedule_plan) stands in for the output, as pretrain_gpt.py returns it."""
    batch, device = next(data_iterator), platform.current().device
    inputs = features.batch_inputs(batch, model, device)
    if inputs is not None:
        batch, packed = inputs
    else:
        batch, packed = {k: v.to(device) for k, v in batch.items()}, {}
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = _on_this_cp_rank(batch)
    loss = partial(loss_func, batch["loss_mask"])
    if parallel_state.get_context_parallel_world_size() > 1 and not get_model_config(model).calculate_per_token_loss:
        loss = partial(_loss_over_cp, batch["loss_mask"])
    if return_schedule_plan:
        plan = model.build_schedule_plan(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            **packed,
        )
        return plan, loss
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        labels=batch["labels"],
        **packed,
    )
    return output, loss


def _on_this_cp_rank(batch: dict) -> dict:
    """megatron's split of a micro-batch over the context-parallel ranks (pretrain_gpt.py get_batch):
    2 x CP chunks of the sequence, rank r keeping chunks r and 2·CP−1−r; the attention mask keeps this
    rank's query rows over every key."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())


def _loss_over_cp(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """loss_func under context parallelism, token-weighted over the CP ranks: the schedule divides each
    rank's summed loss by the count it returns, and the data x context gradient reduction averages the
    CP ranks; returning CP x this rank's sum over the CP group's count makes that the sum of every
    rank's token losses over every rank's tokens, however the loss mask falls across the ranks (the
    per-rank count of megatron's loss_func weighs a rank with fewer loss tokens up). Logged as
    loss_func's: this rank's sum and count."""
    loss, num_tokens, logged = loss_func(loss_mask, output_tensor)
    group = parallel_state.get_context_parallel_group()
    total = num_tokens.clone()
    torch.distributed.all_reduce(total, group=group)
    return loss * torch.distributed.get_world_size(group), total, logged


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt.py's: the summed loss, the token count, and {'lm loss': [sum, count]}. The schedule
    divides by the count (and the micro-batch count) unless --calculate-per-token-loss, where
    finalize_model_grads divides the gradients by the tokens of the whole global batch instead."""
    mask = loss_mask.view(-1).float()
    loss = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def train_step(args, model, optimizer, scheduler, data_iterators, forward_backward_func) -> StepResult:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    losses = run_schedule(args, forward_backward_func, model, data_iterators, num_microbatches)
    _empty_unused_memory(args, 1)
    update_successful, grad_norm, num_zeros = optimizer.step()
    _empty_unused_memory(args, 2)
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    return StepResult(_average_loss(losses), grad_norm, num_zeros, update_successful)


def _empty_unused_memory(args, level: int) -> None:
    """--empty-unused-memory-level, as megatron's train_step: the caching allocator's unused blocks
    are released after the schedule (level >= 1) and after the optimizer step (level >= 2)."""
    if args.empty_unused_memory_level >= level and platform.current().is_cuda:
        torch.cuda.empty_cache()


def run_schedule(args, forward_backward_func, model, data_iterators, num_microbatches: int,
                 forward_only: bool = False, micro_batch_size: int | None = None) -> list:
    """One forward(/backward) over the micro-batches, with megatron's schedule calling convention."""
    return forward_backward_func(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=micro_batch_size or args.micro_batch_size,
        forward_only=forward_only,
    )


def _average_loss(losses: list) -> torch.Tensor:
    """Token-weighted mean over micro-batches and data-parallel ranks, as megatron's train_step
    reduces {'lm loss': [sum, count]}; NaN off the last stage."""
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not losses:
        return torch.tensor(float("nan"))
    total = torch.vstack([x["lm loss"].view(-1) for x in losses]).sum(dim=0).to(platform.current().device)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return total[0] / total[1].clamp(min=1)
