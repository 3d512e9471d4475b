"""Supervised fine-tuning on chat data: megatron's ``--sft``, on the imported model's own tokenizer.

    train.py --sft --data-path chat.jsonl --tokenizer-type HuggingFaceTokenizer --tokenizer-model CKPT/tokenizer
    train.py --sft --data-path chat.jsonl --tokenizer-type SFTTokenizer --tokenizer-model DIR \\
        [--sft-tokenizer-prompt-format nemotron-h-aligned|nemotron-nano-v2|identity|default]

Every line of chat.jsonl is ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the
tokenizer's chat template (chat.py: the assistant mask from rendered prefixes), packed first-fit
decreasing into rows of --seq-length (packing.py), served by megatron-core's dataset builder, samplers
and loaders (dataset.py), attended per conversation (attention.py: transformer-engine's THD packed
sequences, or a block-diagonal causal mask on the local spec). The loss is token-weighted over the
global batch in training (--calculate-per-token-loss, set by --sft) and in validation.

No flags of its own (megatron's --sft, --sft-tokenizer-prompt-format, --chat-template). It plugs in
through the hooks of megatron_ext/training/features.py, as every capability does: before_validate
(the refusals, --calculate-per-token-loss); datasets (--sft's data: ChatData, checked at validation,
every line rendered and masked, and built for the run); batch_inputs (a packed row's
per-conversation attention); around_evaluation (the token-weighted validation loss).
"""
from __future__ import annotations

from megatron_ext.errors import ConfigError

# megatron's SFTTokenizer prompt formats (megatron/core/tokenizers/text/libraries/sft_tokenizer.py:70-107)
PROMPT_FORMATS = ("nemotron-h-aligned", "nemotron-nano-v2", "identity", "default")
TOKENIZERS = ("HuggingFaceTokenizer", "SFTTokenizer")
# GPT-dataset flags that mean nothing to packed conversations (megatron's SFTDataset asserts the first
# three off, megatron/training/datasets/sft_dataset.py:124,174)
_DOCUMENT_FLAGS = ("reset_position_ids", "reset_attention_mask", "create_attention_mask_in_dataloader",
                   "eod_mask_loss")
DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _given(args, dest: str) -> bool:
    return args.config_sources.get(dest, "default") in ("recipe", "cli")


def before_validate(args) -> None:
    """Refusals before megatron's validate_args, and --calculate-per-token-loss for --sft."""
    if args.tokenizer_type == "SFTTokenizer":  # (its prompt format is checked with the tokenizer: training/tokenizer.py)
        if args.chat_template is not None:
            raise ConfigError("--chat-template with --tokenizer-type=SFTTokenizer: its prompt format brings the "
                              "template (--sft-tokenizer-prompt-format); give a template to HuggingFaceTokenizer")
    elif _given(args, "sft_tokenizer_prompt_format"):
        raise ConfigError(f"--sft-tokenizer-prompt-format={args.sft_tokenizer_prompt_format}: read only by "
                          f"--tokenizer-type SFTTokenizer (this run has --tokenizer-type={args.tokenizer_type})")
    if not args.sft:
        return
    if args.mock_data:
        raise ConfigError("--sft with --mock-data: supervised fine-tuning reads conversations, "
                          "--data-path FILE.jsonl")
    if args.tokenizer_type not in TOKENIZERS:
        raise ConfigError(f"--tokenizer-type={args.tokenizer_type} with --sft: conversations are rendered by a "
                          "Hugging Face chat template; use HuggingFaceTokenizer (an import's tokenizer/) or "
                          "SFTTokenizer")
    for dest in _DOCUMENT_FLAGS:  # (megatron's default is an attention mask in the data loader: only given counts)
        if getattr(args, dest) and (dest != "create_attention_mask_in_dataloader" or _given(args, dest)):
            raise ConfigError(f"--{dest.replace('_', '-')}=True with --sft: packed conversations always restart "
                              "their positions, never attend across each other and keep the loss on assistant "
                              "tokens only")
    if args.context_parallel_size > 1 and args.transformer_impl != "local":
        raise ConfigError(f"--context-parallel-size={args.context_parallel_size} with --sft and --transformer-impl="
                          f"{args.transformer_impl}: packed (THD) conversations are not split across context-parallel "
                          "ranks here; the local spec's all_gather or a2a attention keeps each conversation's mask")
    cp_types = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    if args.context_parallel_size > 1 and "p2p" in cp_types:
        raise ConfigError(f"--cp-comm-type=p2p with --sft: ring attention runs the causal triangle only; packed "
                          "conversations need their document mask: use --cp-comm-type all_gather or a2a")
    if args.mtp_num_layers:
        raise ConfigError(f"--mtp-num-layers={args.mtp_num_layers} with --sft: multi-token prediction shifts labels "
                          "across the packed conversations' boundaries")
    for flag, size in (("--micro-batch-size", args.micro_batch_size),
                       ("--eval-micro-batch-size", args.eval_micro_batch_size or 1)):
        if args.transformer_impl == "transformer_engine" and args.pipeline_model_parallel_size > 1 and size > 1:
            raise ConfigError(
                f"{flag}={size} with --sft, --transformer-impl=transformer_engine and "
                f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}: packed (THD) micro-batches are "
                f"flattened into one row, which the pipeline's [seq, micro-batch] messages cannot carry; use {flag} 1")
    if not args.calculate_per_token_loss:
        args.calculate_per_token_loss = True
        args.config_sources["calculate_per_token_loss"] = "sft (the loss is token-weighted over the global batch)"
    args.sft_attention = ("thd: transformer-engine packed sequences (PackedSeqParams cu_seqlens)"
                          if args.transformer_impl == "transformer_engine"
                          else "mask: a per-conversation block-diagonal causal attention mask (local spec)")
    args.config_sources["sft_attention"] = "derived (--sft, --transformer-impl)"


def check_data(args, config, sizes) -> None:
    """Every conversation of every data file renders, masks and fits, and every split that is asked for
    samples holds some: refused by name (the file's flag, the line) before any compute. The encoded files
    are kept for the build."""
    from megatron_ext.sft import packing
    from megatron_ext.sft.dataset import ChatLines

    template = _template(args, config.tokenizer)
    names = ("train", "validation", "test")
    # (blend, split bounds per split, how the split was asked for): --data-path with --split, or a
    # --train/valid/test-data-path holding the whole of its split
    sources = [(config.blend, config.split_matrix, f" (--split={args.split})")] if config.blend else []
    for index, blend in enumerate(config.blend_per_split or ()):
        if blend is not None:
            sources.append((blend, [(0.0, 1.0) if k == index else None for k in range(3)], ""))
    for blend, matrix, note in sources:
        for path in blend[0]:
            flag = _flag_of(args, path)
            try:
                lines = ChatLines(path, template)
            except OSError as e:
                raise ConfigError(f"{flag}={path}: {e.strerror or e} (--sft reads JSON lines)") from None
            except ValueError as e:
                raise ConfigError(f"{flag}={path}: {e}") from None
            for name, bounds, wanted in zip(names, matrix or [None] * 3, sizes):
                if bounds is None or not wanted:
                    continue
                first, last = (int(round(b * len(lines))) for b in bounds)
                usable = sum(packing.cut(e.ids, e.assistant, config.sequence_length) is not None
                             for i in range(first, last) for e in lines[i])
                if not usable:
                    raise ConfigError(
                        f"{flag}={path}{note}: the {name} split ({last - first} of {len(lines)} lines) holds no "
                        f"conversation with an assistant token within --seq-length={config.sequence_length}, but "
                        f"{wanted} {name} samples are needed")


def build_datasets(config, sizes) -> list:
    """(train, validation, test) PackedChatDataset (or megatron's blends of them), as the builder makes
    GPT datasets; rank 0 prints how each split packed."""
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_ext.sft.dataset import PackedChatDataset

    built = BlendedMegatronDatasetBuilder(PackedChatDataset, sizes, lambda: True, config).build()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        for name, dataset, wanted in zip(("train", "validation", "test"), built, sizes):
            for part in getattr(dataset, "datasets", [dataset]) if dataset is not None and wanted else ():
                print(f" > sft {name} ({part.dataset_path}): {part.summary()}", flush=True)
    return built


class ChatData:
    """--sft's data, in place of megatron's GPT datasets (features.py's datasets hook)."""

    check = staticmethod(check_data)
    build = staticmethod(build_datasets)


def datasets(args):
    return ChatData if args.sft else None


def batch_inputs(batch: dict, model, device):
    """A packed row of conversations (its cu_seqlens; packing.assemble) as the model takes it, with
    the attention that never crosses a conversation (attention.packed_inputs); None for another batch."""
    if "cu_seqlens" not in batch:
        return None
    from megatron_ext.sft.attention import packed_inputs

    return packed_inputs(batch, model, device)


def around_evaluation(args):
    """megatron's evaluate() reports the token-weighted loss, as training does (seams/sft.py)."""
    from megatron_ext.seams.sft import token_weighted_evaluation

    return token_weighted_evaluation(args)


def _template(args, tokenizer):
    from megatron_ext.seams.sft import chat_template
    from megatron_ext.sft.chat import ChatTemplate

    try:
        return ChatTemplate(*chat_template(tokenizer))
    except ValueError as e:
        raise ConfigError(f"--tokenizer-type={args.tokenizer_type} --tokenizer-model={args.tokenizer_model}: {e}") from None


def _flag_of(args, path: str) -> str:
    for dest in DATA_FLAGS:
        if path in [p for entry in (getattr(args, dest) or []) for p in str(entry).split()]:
            return "--" + dest.replace("_", "-")
    return "--data-path"


def summary(args) -> str:
    """The startup summary's line (training/features.py): chat data packed per conversation, or off."""
    if not args.sft:
        return "sft: off (no --sft)"
    return (f"sft: conversations of {' '.join(args.data_path or [])} packed into rows of {args.seq_length} "
            f"tokens, {args.tokenizer_type}'s chat template, token-weighted loss")
