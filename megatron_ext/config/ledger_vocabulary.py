"""The ledger's vocabulary (config/ledger.py): the three kinds of entry (Honoured, Refused,
NoEffect), the places a refusal comes from (NOT_HERE, RULES), megatron's code that reads flags and the
function of this loop that calls it (READERS), the reasons several tables share, and Classification:
one table's flags, each classified once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Honoured:
    where: str


@dataclass(frozen=True)
class Refused:
    where: str
    why: str = ""


@dataclass(frozen=True)
class NoEffect:
    why: str


NOT_HERE = "megatron_ext.config.rules:check_not_here"
RULES = "megatron_ext.config.rules:RULES"

# megatron's code that reads flags, and the function of this loop that calls it (or builds it)
TC = "megatron.core.transformer.transformer_config:TransformerConfig"
MLA = "megatron.core.transformer.transformer_config:MLATransformerConfig"
DDP = "megatron.core.distributed.distributed_data_parallel_config:DistributedDataParallelConfig"
OPT = "megatron.core.optimizer.optimizer_config:OptimizerConfig"
CONFIG_FROM_ARGS = "megatron.training.argument_utils:core_transformer_config_from_args"
YARN_FROM_ARGS = "megatron.training.argument_utils:_apply_yarn_config_from_args"
DDP_FROM_ARGS = "megatron.training.training:get_megatron_ddp_config"
VALIDATE = "megatron.training.arguments:validate_args"
SCHEDULER = "megatron.training.training:get_optimizer_param_scheduler"
TOKENIZER = "megatron.core.tokenizers.utils.build_tokenizer:build_tokenizer"
VOCAB_PADDING = "megatron.core.tokenizers.utils.build_tokenizer:vocab_size_with_padding"
BLEND = "megatron.training.utils.common_utils:get_blend_and_blend_per_split"
DATA_LOADER = "megatron.training.datasets.data_samplers:build_pretraining_data_loader"
EVALUATE = "megatron.training.training:evaluate_and_print_results"
EVALUATE_LOOP = "megatron.training.training:evaluate"
WANDB = "megatron.training.global_vars:_set_wandb_writer"

READERS = {  # megatron's reader -> (the function of megatron_ext that calls it, the name it calls)
    TC: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    MLA: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    CONFIG_FROM_ARGS: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    YARN_FROM_ARGS: ("megatron_ext.training.model:transformer_config", "core_transformer_config_from_args"),
    DDP: ("megatron_ext.training.model:_wrap_chunks", "get_megatron_ddp_config"),
    DDP_FROM_ARGS: ("megatron_ext.training.model:_wrap_chunks", "get_megatron_ddp_config"),
    OPT: ("megatron_ext.training.optimizer:build_optimizer", "get_megatron_optimizer_config"),
    VALIDATE: ("megatron_ext.config.command_line:finalize", "validate_args"),
    SCHEDULER: ("megatron_ext.training.optimizer:build_scheduler", "get_optimizer_param_scheduler"),
    TOKENIZER: ("megatron_ext.training.tokenizer:build", "build_tokenizer"),
    VOCAB_PADDING: ("megatron_ext.training.tokenizer:padded_vocab_size", "vocab_size_with_padding"),
    BLEND: ("megatron_ext.training.data:dataset_config", "get_blend_and_blend_per_split"),
    DATA_LOADER: ("megatron_ext.training.data:_iterators", "build_pretraining_data_loader"),
    EVALUATE: ("megatron_ext.training.evaluation:run", "evaluate_and_print_results"),
    EVALUATE_LOOP: (EVALUATE, "evaluate"),  # megatron's evaluate_and_print_results calls it
    WANDB: ("megatron_ext.training.log_line:TrainingLogger._wandb", "_set_wandb_writer"),
}


class Classification:
    """One table of the ledger: dest -> entry, in the order classified; a flag classified twice fails."""

    def __init__(self):
        self.entries: dict = {}

    def _add(self, entry, flags: str) -> None:
        for dest in flags.split():
            assert dest not in self.entries, f"{dest} classified twice"
            self.entries[dest] = entry

    def honoured(self, where: str, flags: str) -> None:
        self._add(Honoured(where), flags)

    def refused(self, why: str, flags: str, where: str = NOT_HERE) -> None:
        self._add(Refused(where, why), flags)

    def no_effect(self, why: str, flags: str) -> None:
        self._add(NoEffect(why), flags)


def merged(*tables: Classification) -> dict:
    """The tables' entries in order, as one ledger; a flag in two tables fails."""
    ledger: dict = {}
    for table in tables:
        for dest, entry in table.entries.items():
            assert dest not in ledger, f"{dest} classified twice"
            ledger[dest] = entry
    return ledger


# --- shared reasons ---------------------------------------------------------------------------
PRETRAIN_GPT_IGNORES = "megatron 0.19.2 reads it nowhere (Megatron-LM's pretrain_gpt.py ignores it too)"
OTHER_MODELS = "for Megatron-LM's other models (BERT, T5, vision, retrieval); pretrain_gpt.py does not read it"
INFERENCE = "megatron's inference engine and text-generation server; training does not read it"
RL = "megatron's reinforcement learning (--perform-rl-step, refused here)"
HYBRID = "hybrid (Mamba) models only: --hybrid-layer-pattern / --is-hybrid-model are refused here"
ONE_LOGGER = "NVIDIA's one-logger telemetry, which this loop does not send (the flag only turns it off or names it)"


def only_with(flag: str) -> str:
    return f"read only with {flag}, which is refused here"
