"""A Hugging Face config.json as read: every field read is recorded (Config), so the unread ones can be
refused by name (IGNORED: the fields that say nothing about the weights or the forward pass); the
one-line refusal naming a field (refuse); and the rope parameters every family reads first."""
from __future__ import annotations

from megatron_ext.errors import ConfigError

# config fields that say nothing about the weights or the forward pass
IGNORED = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "output_router_logits", "initializer_range", "return_dict", "output_hidden_states",
    "output_attentions", "tie_encoder_decoder", "is_encoder_decoder", "_name_or_path", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "task_specific_params", "tokenizer_class", "prefix", "sep_token_id",
    "decoder_start_token_id", "add_cross_attention", "cross_attention_hidden_size", "is_decoder", "pruned_heads",
    "torchscript", "tf_legacy_loss", "use_bfloat16", "finetuning_task", "max_window_layers",
    "auto_map",  # where remote code lives (the family's table and flags stand for it)
}


class Config:
    """The HF config dict; every field read is recorded, so the unread ones can be refused by name."""

    def __init__(self, raw: dict):
        self.raw, self.read = raw, set()

    def __getitem__(self, key):
        self.read.add(key)
        if key not in self.raw:
            raise ConfigError(f"config.json: field {key!r} is missing")
        return self.raw[key]

    def get(self, key, default=None):
        self.read.add(key)
        return self.raw.get(key, default)

    def expect(self, key, allowed, why: str):
        value = self.get(key, allowed[0])
        if value not in allowed:
            raise refuse(key, value, why)
        return value

    def unread(self) -> list[str]:
        return sorted(k for k in self.raw if k not in self.read and k not in IGNORED)


def refuse(key, value, why: str) -> ConfigError:
    return ConfigError(f"config.json: {key}={value!r}: {why}")


def rope_parameters(c: Config) -> tuple[dict, int, str]:
    """(the rope parameters not yet read, the base, the rope type): what every family's rope reads
    first; what it leaves is refused by refuse_unread_rope."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None)
    if theta is None:
        theta = c["rope_theta"]
    if float(theta) != int(theta):
        raise refuse("rope_theta", theta, "megatron's --rotary-base is an integer")
    return rope, int(theta), rope.pop("rope_type", rope.pop("type", "default"))


def refuse_unread_rope(rope: dict, kind: str) -> None:
    if rope:
        key = sorted(rope)[0]
        raise refuse(f"rope_parameters.{key}", rope[key], f"not representable for rope_type {kind}")


def rope_get(c: Config, key):
    return (c.raw.get("rope_parameters") or c.raw.get("rope_scaling") or {}).get(key)
