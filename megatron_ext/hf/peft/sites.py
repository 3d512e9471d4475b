"""Where each adapter lives on both sides: peft's module (or stacked parameter) names and megatron's
LoRA parameters, per family."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_ext.errors import ConfigError
from megatron_ext.hf import families
from megatron_ext.lora import targets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
BASE = "base"  # the base import's directory inside an adapter import

# transformers v5 holds these under other module names than its checkpoints (the tables' names)
_V5_NAMES = {"mixtral": (("block_sparse_moe.gate", "mlp.gate"),)}


@dataclass(frozen=True)
class Stacked:
    """How a family's transformers (v5) model stacks its routed experts: the fc1 and fc2 parameters
    under the layer, whether peft's ParamWrapper swaps their last two dimensions (it does unless the
    experts module says ``is_transposed``), whether the expert's linear is the parameter's transpose
    (x @ W, not x @ W^T), and how fc1 holds gate and up (concatenated halves or interleaved columns)."""
    fc1: str
    fc2: str
    peft_swaps: bool
    transposed: bool
    halves: str


_OUT_IN = dict(peft_swaps=True, transposed=False, halves="concat")  # [E, out, in], F.linear(x, W[e])
STACKED = {
    "qwen3_moe": Stacked("mlp.experts.gate_up_proj", "mlp.experts.down_proj", **_OUT_IN),
    "mixtral": Stacked("mlp.experts.gate_up_proj", "mlp.experts.down_proj", **_OUT_IN),
    "deepseek_v3": Stacked("mlp.experts.gate_up_proj", "mlp.experts.down_proj", **_OUT_IN),
    "deepseek_v2": Stacked("mlp.experts.gate_up_proj", "mlp.experts.down_proj", **_OUT_IN),
    # [E, in, out], x @ W[e], is_transposed: peft keeps the order; gate and up interleaved
    "gpt_oss": Stacked("mlp.experts.gate_up_proj", "mlp.experts.down_proj", peft_swaps=False, transposed=True,
                       halves="interleave"),
    # [E, in, out], x @ W[e], no is_transposed: peft swaps, so its lora_A is the output side
    "llama4_text": Stacked("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj", peft_swaps=True,
                           transposed=True, halves="concat"),
}

# peft (0.21, on transformers v5) rewrites a LoRA config of these families as it loads it: a
# target_modules name below is taken for a v4 per-expert linear and moved onto the stacked experts
# (utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_MAPPING), so a dense layer's or a
# shared expert's gate_proj named there would lose its adapter. Such linears go out as
# target_parameters (``mlp.gate_proj.weight``), which peft adapts as they are.
PEFT_MOVES = {"qwen3_moe": {"gate", "gate_proj", "up_proj", "down_proj"},
              "deepseek_v3": {"gate", "gate_proj", "up_proj", "down_proj"},
              "deepseek_v2": {"gate", "gate_proj", "up_proj", "down_proj"},
              "mixtral": {"gate", "w1", "w2", "w3"}}

PARTS = {"copy": ("all",), "glu": ("gate", "up"), "qkv": ("q", "k", "v")}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Site:
    """One peft adapter: a 2-D linear (``module``: one megatron part) or a layer's stacked experts
    (``experts``: one megatron linear per expert, ``fc`` 1 or 2)."""
    peft: str  # the HF module path (2-D) or parameter path (stacked), without PREFIX
    module: str = ""  # megatron module path (2-D)
    part: str = "all"
    kind: str = "copy"  # the table row's transform (2-D)
    experts: tuple = ()  # megatron module paths, expert order (stacked)
    fc: int = 0
    aliases: tuple = ()  # other peft names of the same module (the checkpoint's, where v5 renames it)
    per_expert: bool = False  # one expert's linear by the checkpoint's name: adapters peft wrote under v4 (import only)
    hf_weight: str = ""  # the base tensor it adapts (2-D)
    hf_parts: tuple = ()  # the base tensors of one expert, or the stacked one (stacked)
    as_parameter: bool = False  # exported as target_parameters (see PEFT_MOVES; routers; stacked)


def _v5(model_type: str, name: str) -> str:
    for old, new in _V5_NAMES.get(model_type, ()):
        name = name.replace(old, new)
    return name


def layer_suffix(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``self_attn.q_proj`` (the path inside the layer)."""
    return _LAYER.sub("", name)


def sites(model_type: str, c: families.Config, rows) -> list[Site]:
    """Every adapter the model's rows allow (table.expand's rows: megatron names, HF names, kind)."""
    out, stacks, base = [], {}, {}
    moved = PEFT_MOVES.get(model_type, set())
    for mgs, hfs, kind in rows:
        if not mgs[0].endswith(".weight"):
            continue
        modules = [m[: -len(".weight")] for m in mgs]
        if modules[0].rsplit(".", 1)[-1] not in targets.NAMES:
            continue
        if ".local_experts." in modules[0]:  # routed experts: stacked below (and v4 per-expert names)
            layer = int(modules[0].split(".")[2])
            fc = 1 if modules[0].endswith("linear_fc1") else 2
            stacks.setdefault((layer, fc), []).extend(modules)
            base.setdefault((layer, fc), tuple(hfs))
            if len(mgs) == 1 and kind in PARTS:
                for h, part in zip(hfs, PARTS[kind]):
                    out.append(Site(peft=h[: -len(".weight")], module=modules[0], part=part, kind=kind,
                                    hf_weight=h, per_expert=True))
            continue
        for h, part in zip(hfs, PARTS[kind]):
            name = h[: -len(".weight")]
            v5 = _v5(model_type, name)
            leaf = v5.rsplit(".", 1)[-1]
            out.append(Site(peft=v5, module=modules[0], part=part, kind=kind, hf_weight=h,
                            aliases=(name,) if name != v5 else (),
                            as_parameter=leaf in moved or modules[0].endswith(targets.ROUTER)))
    if stacks and model_type not in STACKED:
        raise ConfigError(f"peft adapters of {model_type}'s routed experts are not mapped")
    for (layer, fc), experts in sorted(stacks.items()):
        spec = STACKED.get(model_type)
        name = f"model.layers.{layer}.{spec.fc1 if fc == 1 else spec.fc2}"
        order = sorted(experts, key=lambda m: int(m.split(".local_experts.")[1].split(".")[0]))
        out.append(Site(peft=name, experts=tuple(order), fc=fc, hf_parts=base[(layer, fc)], as_parameter=True))
    return out


def scale_of(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / (math.sqrt(rank) if rslora else rank)


def param_name(module: str, part: str, factor: str) -> str:
    return f"{module}.lora.{part}.lora_{factor}.weight"


def peft_keys(site: Site, stacked_targets: dict) -> list[tuple[str, str]]:
    """(peft key of A, of B) for each name peft may have given the site."""
    if site.experts:
        module, _, param = site.peft.rpartition(".")
        order = stacked_targets.get(module, [param])
        nested = "base_layer." * (len(order) - 1 - order.index(param)) if param in order else ""
        return [(f"{PREFIX}{module}.{nested}lora_A.weight", f"{PREFIX}{module}.{nested}lora_B.weight")]
    names = [site.peft, *site.aliases]
    return [(f"{PREFIX}{n}.lora_A.weight", f"{PREFIX}{n}.lora_B.weight") for n in names]

