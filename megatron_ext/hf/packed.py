"""The model's logits on several sequences packed into one forward (scripts/convert.py logits).

The sequences go into one row, one after the other, then padding to a length the layout takes (a
multiple of the tensor-parallel size: sequence parallelism splits the row). Positions restart at 0 at
each sequence (and at the padding), and the attention is the supervised fine-tuning's packed attention
on the local spec (megatron_ext/sft/attention.py): causal inside each sequence, closed between them,
the padding a segment of its own. Torch's attention (--attention-backend auto / flash) takes the mask
on every layer (flex_attention's document mask from its segment ids on CUDA); megatron's unfused one
through the mask seam that keeps it on every layer. So each sequence's
logits are the ones it has alone; this is how packed attention is checked against transformers running
each sequence by itself. One sequence without padding runs with megatron's own causal attention.
A run trained with LoRA runs with its adapters (the base its checkpoint records, then the adapters).
"""
from __future__ import annotations

import os

import torch

from megatron_ext.errors import ConfigError


def row(sequences: list[list[int]], multiple: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, S], positions [1, S], cu_seqlens [1, n + 2]) of the sequences packed into one row
    padded to a multiple of ``multiple`` (the padding a segment of its own; empty when none)."""
    total = sum(len(s) for s in sequences)
    length = -(-total // multiple) * multiple
    tokens = torch.zeros(1, length, dtype=torch.long)
    positions = torch.zeros(1, length, dtype=torch.long)
    bounds, start = [0], 0
    for seq in sequences:
        tokens[0, start:start + len(seq)] = torch.tensor(seq, dtype=torch.long)
        positions[0, start:start + len(seq)] = torch.arange(len(seq))
        start += len(seq)
        bounds.append(start)
    positions[0, start:] = torch.arange(length - start)
    bounds.append(length)
    return tokens, positions, torch.tensor([bounds], dtype=torch.int32)


def logits(load: str, ids, recipe: str | None = None, extra: list[str] = (), *, parse) -> torch.Tensor | None:
    """The model's fp32 logits [tokens, vocab] on ``ids`` (one sequence of token ids, or a list of
    sequences packed into one forward: one row per token, in order) under this process's layout
    (every rank calls; rank 0 returns them, the others None)."""
    from megatron_ext import platform

    platform.setup()  # before megatron-core is imported
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_ext.hf import checkpoint, world
    from megatron_ext.seams import registry, sft as sft_seams
    from megatron_ext.sft.attention import block_causal_mask, segment_ids

    sequences = [list(ids)] if ids and not isinstance(ids[0], (list, tuple)) else [list(s) for s in ids]
    if not sequences or any(not s for s in sequences):
        raise ConfigError("--input-ids: every sequence needs a token (sequences are separated by ';')")
    if world.layout_flag(extra, "--context-parallel-size") > 1:
        raise ConfigError("--context-parallel-size: logits runs the packed row on one context-parallel rank")
    tokens, positions, cu_seqlens = row(sequences, world.layout_flag(extra, "--tensor-model-parallel-size"))
    total, seq = sum(len(s) for s in sequences), tokens.shape[1]
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    with checkpoint.loaded(checkpoint.find(load, recipe), ["--seq-length", str(seq), *extra], parse=parse) as run:
        args, model = run.args, run.model
        device = platform.current().device
        # an import's config's rows; a model trained from a recipe: its embedding's
        vocab = args.padded_vocab_size
        if checkpoint.imported(args):
            vocab = checkpoint.hf_config(args, load)[1]["vocab_size"]
        tokens, positions = tokens.to(device), positions.to(device)
        mask = None
        if cu_seqlens.shape[1] > 2 or seq > total:  # several segments: attention stays inside each
            mask = block_causal_mask(segment_ids(cu_seqlens.to(device), seq))
            registry.apply_for_run(sft_seams.PACKED_CAUSAL_MASK)  # removed by the run's teardown
        for chunk in model:
            chunk.eval()

        def forward_step(_iterator, chunk):
            out = chunk(tokens, positions, mask)

            def keep(output, non_loss_data=False):
                return output

            return out, keep

        # the interleaved schedule runs at least one micro-batch per pipeline stage: the same row each time
        n = parallel_state.get_pipeline_model_parallel_world_size() if len(model) > 1 else 1
        with torch.no_grad():
            collected = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[iter([None] * n)] * len(model) if len(model) > 1 else iter([None]),
                model=model if len(model) > 1 else model[0], num_microbatches=n, seq_length=seq,
                micro_batch_size=1, forward_only=True, collect_non_loss_data=True)
        result = None
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            full = gather_from_tensor_model_parallel_region(collected[0].float())  # [1, seq, vocab]
            result = full[0, :total, :vocab].cpu().contiguous()
        # the lowest rank of the last pipeline stage sends them to global rank 0
        holder = torch.tensor([torch.distributed.get_rank() if result is not None else processes], device=device)
        torch.distributed.all_reduce(holder, op=torch.distributed.ReduceOp.MIN)
        src = int(holder.item())
        if src != 0:
            box = [result]
            torch.distributed.broadcast_object_list(box, src=src)
            result = box[0]
        return result if torch.distributed.get_rank() == 0 else None


def parse_ids(text: str) -> list[list[int]]:
    """``--input-ids 1,2,3;4,5`` -> [[1, 2, 3], [4, 5]]."""
    try:
        out = [[int(x) for x in part.split(",") if x.strip()] for part in text.split(";") if part.strip()]
    except ValueError:
        raise ConfigError(f"--input-ids={text}: comma-separated token ids, sequences separated by ';'") from None
    if not out or any(not s for s in out):
        raise ConfigError(f"--input-ids={text}: comma-separated token ids, sequences separated by ';'")
    return out
