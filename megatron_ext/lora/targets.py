"""Which linears of a model a LoRA run adapts, named as --lora-target-modules names them.

A module's *target path* is its path in the model with the layer and expert indices dropped and
``experts.local_experts`` shortened to ``experts``: ``decoder.layers.self_attention.linear_qkv``,
``decoder.layers.mlp.linear_fc1`` (a dense MLP), ``decoder.layers.mlp.experts.linear_fc1`` (every routed
expert), ``decoder.layers.mlp.shared_experts.linear_fc1``, ``decoder.layers.mlp.router``,
``mtp.layers.transformer_layer.self_attention.linear_proj``. A target names a module when it is its
target path or a dotted tail of it: ``linear_fc1`` names every fc1 (dense, routed and shared experts),
``experts.linear_fc1`` the routed experts' only, ``mlp.linear_fc1`` the dense MLPs' only.

A target may also be peft's name (the Hugging Face module, as each family's weight table in
megatron_ext/hf/weight_tables.py names it, and as an exported adapter speaks), alone or as a dotted tail:
it names the megatron linear that holds the module and, where that linear fuses several (linear_qkv,
a gated linear_fc1), its canonical part:

  q_proj k_proj v_proj     linear_qkv's q / k / v (multi-latent attention: q_proj = linear_q_proj)
  o_proj                   linear_proj
  gate_proj up_proj        linear_fc1's gate / up (a non-gated fc1, Nemotron's up_proj: the whole linear)
  down_proj                linear_fc2
  q_a_proj q_b_proj        linear_q_down_proj, linear_q_up_proj (multi-latent attention)
  kv_a_proj_with_mqa       linear_kv_down_proj
  kv_b_proj                linear_kv_up_proj
  gate                     router (Qwen3-MoE, DeepSeek, Mixtral: mlp.gate, block_sparse_moe.gate)
  gate_up_proj             experts.linear_fc1 (stacked experts), w1 / w3 its gate / up, w2 experts.linear_fc2
                           (Mixtral)
  self_attn, feed_forward, block_sparse_moe, shared_expert (in a dotted name): self_attention, mlp, mlp,
                           shared_experts

The parts a target set leaves out of a fused linear (k_proj when it names q_proj and v_proj) hold
A = B = 0: they add nothing and their gradients are zero, so they stay zero, as peft has no adapter
there (an export leaves them out).

Nothing here imports megatron-core at import time (argument parsing imports this package).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from megatron_ext.errors import ConfigError

# The linears of the local layer spec a target may name (megatron-core's attribute names):
# standard attention, multi-latent attention (transformer/multi_latent_attention.py), the MLP.
ATTENTION = ("linear_qkv", "linear_proj")
MLA = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
MLP = ("linear_fc1", "linear_fc2")
ROUTER = "router"
NAMES = ATTENTION + MLA + MLP + (ROUTER,)
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # the others are column-parallel

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def target_path(module_path: str) -> str:
    """``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1`` -> ``decoder.layers.mlp.experts.linear_fc1``."""
    return _INDEX.sub("", module_path).replace("experts.local_experts", "experts")


def names(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def matches(path: str, parts, target) -> bool:
    """Whether ``target`` (resolve's Target) adapts the linear at target path ``path`` whose canonical
    ``parts`` are [(part, out features)]: it names the linear (a peft name this model cannot have names
    none) and, for a part, the linear has that part."""
    return (target.name is not None and names(path, target.name)
            and (target.part is None or target.part in dict(parts)))


def model_paths(args) -> dict:
    """{target path: (in features, [(part, out features)])} of the linears this run's model has
    (global sizes, canonical parts; the MTP block repeats the decoder's and is left out: a target
    that names a decoder linear names its MTP copy too). From the flags alone, for validation."""
    h = args.hidden_size
    out: dict = {}
    layer = "decoder.layers."
    if args.multi_latent_attention:
        heads = args.num_attention_heads
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            out[layer + "self_attention.linear_q_proj"] = (h, [("all", heads * q_head)])
        else:
            out[layer + "self_attention.linear_q_down_proj"] = (h, [("all", args.q_lora_rank)])
            out[layer + "self_attention.linear_q_up_proj"] = (args.q_lora_rank, [("all", heads * q_head)])
        out[layer + "self_attention.linear_kv_down_proj"] = (h, [("all", args.kv_lora_rank + args.qk_pos_emb_head_dim)])
        out[layer + "self_attention.linear_kv_up_proj"] = (
            args.kv_lora_rank, [("all", heads * (args.qk_head_dim + args.v_head_dim))])
        out[layer + "self_attention.linear_proj"] = (heads * args.v_head_dim, [("all", h)])
    else:
        d = args.kv_channels or h // args.num_attention_heads
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        out[layer + "self_attention.linear_qkv"] = (
            h, [("q", args.num_attention_heads * d), ("k", groups * d), ("v", groups * d)])
        out[layer + "self_attention.linear_proj"] = (args.num_attention_heads * d, [("all", h)])

    def mlp(prefix, ffn):
        fc1 = [("gate", ffn), ("up", ffn)] if glu(args) else [("all", ffn)]
        out[prefix + "linear_fc1"] = (h, fc1)
        out[prefix + "linear_fc2"] = (ffn, [("all", h)])

    if dense_layers(args):
        mlp(layer + "mlp.", args.ffn_hidden_size)
    if args.num_experts:
        mlp(layer + "mlp.experts.", args.moe_ffn_hidden_size or args.ffn_hidden_size)
        if args.moe_shared_expert_intermediate_size:
            mlp(layer + "mlp.shared_experts.", args.moe_shared_expert_intermediate_size)
        out[layer + "mlp.router"] = (h, [("all", args.num_experts)])
    return out


def glu(args) -> bool:
    """A gated linear unit: fc1 = [gate; up] (--swiglu, or --quick-geglu as gpt-oss; megatron's config
    builder sets gated_linear_unit for both, training/argument_utils.py:314-325)."""
    return bool(args.swiglu or args.quick_geglu)


def dense_layers(args) -> bool:
    """Does the decoder have a layer with a dense MLP? (--moe-layer-freq's zeros)"""
    if not args.num_experts:
        return True
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return freq > 1
    return 0 in list(freq)


# ---------------------------------------------------------------------------------------------
# peft's names -> megatron's linear and part
# ---------------------------------------------------------------------------------------------
# leaf -> (a scope it implies, megatron's linear, part); a callable picks by the model's flags
_PEFT_LEAVES = {
    "q_proj": lambda args: ("", "linear_q_proj", None) if args.multi_latent_attention else ("", "linear_qkv", "q"),
    "k_proj": lambda args: None if args.multi_latent_attention else ("", "linear_qkv", "k"),
    "v_proj": lambda args: None if args.multi_latent_attention else ("", "linear_qkv", "v"),
    "o_proj": ("", "linear_proj", None),
    "q_a_proj": ("", "linear_q_down_proj", None),
    "q_b_proj": ("", "linear_q_up_proj", None),
    "kv_a_proj_with_mqa": ("", "linear_kv_down_proj", None),
    "kv_b_proj": ("", "linear_kv_up_proj", None),
    "gate_proj": lambda args: ("", "linear_fc1", "gate") if glu(args) else None,
    "up_proj": lambda args: ("", "linear_fc1", "up" if glu(args) else None),
    "down_proj": ("", "linear_fc2", None),
    "gate_up_proj": ("experts", "linear_fc1", None),
    "w1": lambda args: ("experts", "linear_fc1", "gate") if glu(args) else None,
    "w3": lambda args: ("experts", "linear_fc1", "up") if glu(args) else None,
    "w2": ("experts", "linear_fc2", None),
    "gate": ("", ROUTER, None),
}
PEFT_NAMES = tuple(_PEFT_LEAVES)
_PEFT_SCOPES = {"self_attn": "self_attention", "feed_forward": "mlp", "block_sparse_moe": "mlp",
                "shared_expert": "shared_experts"}
ALL_LINEAR = "all-linear"  # peft's name for every linear of the model


@dataclass(frozen=True)
class Target:
    """One --lora-target-modules name: as given, megatron's (a linear's name or a dotted tail of a
    target path) and the canonical part it adapts (None: the whole linear)."""
    given: str
    name: str | None
    part: str | None = None


def closest(word: str, pool) -> str | None:
    close = difflib.get_close_matches(word, list(pool), n=1, cutoff=0.5)
    return close[0] if close else None


def resolve(given: str, args, flag: str = "--lora-target-modules") -> Target:
    """``q_proj`` -> Target("q_proj", "linear_qkv", "q"); a megatron name as it is; ``name`` None for
    a peft name of a linear this model cannot have (k_proj under multi-latent attention, gate_proj of
    a non-gated MLP). Refuses a name LoRA does not adapt, with the closest that it does, naming
    ``flag`` (the flag that gave it)."""
    *scope, leaf = given.split(".")
    if any(c.isdigit() for c in scope):
        raise ConfigError(f"{flag}={given}: no layer or expert index: a target names its linear "
                          f"in every layer (and expert); did you mean {'.'.join(c for c in scope if not c.isdigit())}"
                          f"{'.' if scope else ''}{leaf}?")
    scope = [_PEFT_SCOPES.get(c, c) for c in scope]
    if leaf in NAMES:
        return Target(given, ".".join([*scope, leaf]))
    entry = _PEFT_LEAVES.get(leaf)
    if entry is None:
        close = closest(leaf, [*NAMES, *PEFT_NAMES])
        hint = f"did you mean {'.'.join([*given.split('.')[:-1], close])}?" if close else (
            f"one of {', '.join(NAMES)}, or peft's {', '.join(PEFT_NAMES)}")
        raise ConfigError(f"{flag}={given}: not a linear LoRA adapts; {hint}")
    mapped = entry(args) if callable(entry) else entry
    if mapped is None:
        return Target(given, None)
    implied, name, part = mapped
    if implied and (not scope or scope[-1] != implied):
        scope.append(implied)
    return Target(given, ".".join([*scope, name]), part)


def resolve_all(names: list, args) -> list[Target]:
    """Every name resolved; every refusal at once, one line each."""
    out, problems = [], []
    for given in names:
        try:
            out.append(resolve(given, args))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def parts_adapted(path: str, chosen: list[Target]) -> set | None:
    """The canonical parts of the linear at target path ``path`` that ``chosen`` names: None for every
    part (a target names the whole linear), an empty set when none names it."""
    found: set = set()
    for t in chosen:
        if t.name is not None and names(path, t.name):
            if t.part is None:
                return None
            found.add(t.part)
    return found
