"""The adapter directory's adapter_config.json: every field understood or refused by name."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from megatron_ext.errors import ConfigError
from megatron_ext.hf import hfdir
from megatron_ext.hf.peft.sites import CONFIG_FILE, WEIGHTS_FILE

# fields whose value does not change what the adapter computes
_INERT = {"base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping", "peft_version",
          "megatron_core", "qalora_group_size", "runtime_config", "layers_to_transform", "layers_pattern",
          "exclude_modules", "fan_in_fan_out"}  # the last four: which modules have tensors, the tensors say it
_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "target_parameters",
         "rank_pattern", "alpha_pattern", "bias", "use_dora", "modules_to_save", "init_lora_weights"}
_PLAIN_INITS = (True, False, "gaussian")


def read_config(peft_dir: str) -> dict:
    """adapter_config.json, every field either understood or off; refusals name the field."""
    flag = f"--peft={peft_dir}"
    cfg = hfdir.read_json(flag, peft_dir, CONFIG_FILE, "a peft adapter directory",
                          required=((WEIGHTS_FILE, "only safetensors adapters are read"),))

    def refuse(key, why):
        return ConfigError(f"{flag}: {CONFIG_FILE}: {key}={cfg.get(key)!r}: {why}")

    if cfg.get("peft_type") != "LORA":
        raise refuse("peft_type", "only LoRA adapters are read")
    if cfg.get("use_dora"):
        raise refuse("use_dora", "DoRA's magnitude vectors have no counterpart here (LoRA only)")
    if cfg.get("bias", "none") != "none":
        raise refuse("bias", "the adapter trains the base's biases; only bias='none' is represented")
    if cfg.get("modules_to_save"):
        raise refuse("modules_to_save", "whole trained copies of base modules are not represented (LoRA only)")
    if cfg.get("init_lora_weights", True) not in _PLAIN_INITS:
        raise refuse("init_lora_weights", "peft rewrites the base weights when it loads such an adapter; convert it "
                     "to a plain LoRA adapter first (peft's path_initial_model_for_weight_conversion)")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise refuse(key, "a positive number")
    for key, value in sorted(cfg.items()):
        if key in _READ or key in _INERT or value in (None, False, {}, []):
            continue
        raise refuse(key, "not representable in megatron_ext's LoRA (rank, alpha, rslora, dropout and the "
                     "adapted linears are)")
    return cfg


def pattern_value(patterns: dict, name: str, default):
    """peft's rank_pattern / alpha_pattern lookup (utils/other.py get_pattern_key)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


@dataclass
class Adapter:
    """A peft adapter read into our names: the LoRA flags it implies and its tensors."""
    rank: int
    alpha: float
    rslora: bool
    dropout: float
    tensors: dict = field(default_factory=dict)  # our parameter name -> tensor

