"""LEDGER: every flag of megatron's parser (megatron.training.arguments.add_megatron_arguments) and
what it does in this loop, one of

    Honoured(where)      the code that reads it: a function of megatron_ext, or megatron's own code
                         this loop calls (READERS names who calls it); a megatron config class means
                         every field of that name is copied from the flag by megatron's from-args
                         builder, and megatron-core's modules read the config
    Refused(where, why)  refused by name before any compute. NOT_HERE: by the ledger's own rule
                         (config/rules.py check_not_here) whenever the flag is set to anything but its
                         default, with `why`; RULES: by a rule of config/rules.py naming it; else
                         the function of megatron_ext that raises the refusal
    NoEffect(why)        accepted and without effect here, by design, and why (mostly: megatron's
                         pretrain_gpt.py does not read it either)

tests/config/test_ledger.py fails when megatron's parser has a flag the ledger does not classify,
when an honoured flag is not read where the ledger says, or when a refused one is not refused.
docs/flags.md lists the ledger (scripts/flags_doc.py).

The tables: ledger_model.py (the model's flags: its configuration, size, precision, layout, optimizer)
and ledger_run.py (the run's: the loop, checkpoints, distribution, data, tokenizer, logging, and
Megatron-LM's other programs); the kinds, the readers and the shared reasons: ledger_vocabulary.py."""
from __future__ import annotations

from megatron_ext.config import ledger_model, ledger_run
from megatron_ext.config.ledger_vocabulary import NOT_HERE, READERS, RULES, Honoured, NoEffect, Refused, merged

# the ledger's readers (tests/config/test_ledger.py, scripts/flags_doc.py) name everything through this entry
__all__ = ["LEDGER", "OPTIONAL", "not_here", "Honoured", "Refused", "NoEffect", "NOT_HERE", "RULES", "READERS"]

LEDGER: dict = merged(ledger_model.MODEL, ledger_run.RUN)
# Flags megatron adds only where an optional package is installed (NVIDIA kitchen).
OPTIONAL = {"kitchen_config_file", "kitchen_recipe_number"}


def not_here() -> dict:
    """dest -> why, for the flags refused whenever set (config/rules.py check_not_here)."""
    return {dest: e.why for dest, e in LEDGER.items() if isinstance(e, Refused) and e.where == NOT_HERE}
