"""LoRA's options: one typed dataclass (config/typed.py), the one place their flags, defaults, ranges and
help live."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, option


@dataclasses.dataclass
class LoRAOptions(Options):
    PREFIX = "lora_"  # --lora-<field>

    rank: int | None = option(None, Domain(int, 1), "model size", metavar="R")
    """Train LoRA adapters of rank R on the targeted linears; every other weight is frozen (no gradient, no
    optimizer state). Not given: LoRA is off."""

    alpha: float | None = option(None, Domain(float, 0, lo_open=True), "positive", metavar="A")
    """The adapters' scale is alpha / rank (peft's lora_alpha). Default: the rank (scale 1)."""

    dropout: float = option(0.0, Domain(float, 0, 1, hi_open=True), "probability", metavar="P")
    """Dropout on the adapters' input, in [0, 1) (peft's lora_dropout). Default 0."""

    target_modules: list[str] | None = option(None, metavar="NAME")
    """The linears to adapt, by megatron-core's names: linear_qkv, linear_proj, linear_q_proj,
    linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, linear_fc1, linear_fc2,
    router; a dotted tail of a module path narrows it (experts.linear_fc1 = the routed experts only,
    shared_experts.linear_fc2, mlp.linear_fc1 = the dense MLPs only); or by peft's (Hugging Face) names:
    q_proj, k_proj, v_proj (linear_qkv's parts), o_proj, gate_proj, up_proj (linear_fc1's parts), down_proj,
    multi-latent attention's q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, the router's gate, the
    experts' gate_up_proj, w1, w2, w3; all-linear = every attention and MLP linear the model has and the
    router. Default: every attention and MLP linear the model has (not the router)."""

    rslora: bool = False
    """Rank-stabilised scale alpha / sqrt(rank) (peft's use_rslora)."""

    fused_adapters: list[str] | None = option(None, metavar="NAME", nargs="*")
    """One adapter per linear (one A for linear_qkv's query, key and value rows, one for a gated
    linear_fc1's two halves) instead of the canonical separate q / k / v and gate / up adapters: on every
    linear, or on the ones named as --lora-target-modules names them (e.g. experts.linear_fc1: peft's
    adapter of a stacked gate_up_proj is one pair per expert)."""

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale(self) -> float:
        alpha = self.alpha if self.alpha is not None else float(self.rank)
        return alpha / (self.rank ** 0.5 if self.rslora else self.rank)
