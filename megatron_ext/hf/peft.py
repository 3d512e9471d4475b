"""LoRA adapters in and out of peft's format (``adapter_config.json`` + ``adapter_model.safetensors``).

    import_peft(hf_dir, peft_dir, save)   the base imported into SAVE/base, the adapters into an adapter
                                          checkpoint at SAVE (its recipe: the base's plus the LoRA flags)
    export_peft(load, out)                a LoRA run's adapters -> a directory PeftModel.from_pretrained loads

peft names an adapter by the Hugging Face module it adapts (``base_model.model.`` + the module path +
``.lora_A.weight`` / ``.lora_B.weight``), and those names come from the family's weight table
(families.py): a row's megatron linear and HF names give each adapter part its peft module (``q``, ``k``,
``v`` of linear_qkv: q_proj, k_proj, v_proj; ``gate``, ``up`` of a gated linear_fc1; ``all`` otherwise).
The canonical parts map 1:1 (their B rows are the HF rows in order). A fused adapter (one A for the
linear, --lora-fused-adapters) exports with its A repeated for each part and its B cut as the base's
rows are (the GQA interleave of linear_qkv undone, [gate; up] halved).

Routed experts: transformers (v5) holds a MoE layer's experts stacked in one 3-D parameter per
projection, which peft adapts through ``target_parameters``: A [r * E, ...] and B [..., r * E], expert e
in A's rows e*r .. e*r+r and in B's columns e, e+E, ... (peft's ParamWrapper). One such adapter over
``gate_up_proj`` shares A between gate and up: it is megatron's fused expert fc1
(``--lora-fused-adapters experts.linear_fc1``). Canonical gate and up adapters go out as peft's own
conversion of per-expert adapters makes them: rank 2r, A = [A_gate; A_up], B block-diagonal, with
``rank_pattern`` / ``alpha_pattern`` keeping the scale; such a block-diagonal adapter comes back in as
canonical parts. Per-expert adapters keyed by the checkpoint's names (``mlp.experts.5.gate_proj``,
what peft wrote under transformers v4) come in as canonical parts too.

What cannot be represented exactly is refused by name, one line: DoRA, biases, modules_to_save, trainable
tokens, a rank or scale that differs between adapters (rank_pattern / alpha_pattern), peft variants that
rewrite the base when loaded, an adapter of a module megatron_ext does not adapt, a tensor whose shape
does not match the base (an adapter of another model). A part a peft adapter leaves out (k_proj when it
adapts q_proj and v_proj) holds A = B = 0: it adds nothing, its gradients are zero so it stays zero, and
an export leaves it out.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import checkpoint, families, hfdir, importer, outputs, table
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
_PEFT_MOVES = {"qwen3_moe": {"gate", "gate_proj", "up_proj", "down_proj"},
               "deepseek_v3": {"gate", "gate_proj", "up_proj", "down_proj"},
               "deepseek_v2": {"gate", "gate_proj", "up_proj", "down_proj"},
               "mixtral": {"gate", "w1", "w2", "w3"}}

_PARTS = {"copy": ("all",), "glu": ("gate", "up"), "qkv": ("q", "k", "v")}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


# ---------------------------------------------------------------------------------------------
# where each adapter lives on both sides
# ---------------------------------------------------------------------------------------------
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
    as_parameter: bool = False  # exported as target_parameters (see _PEFT_MOVES; routers; stacked)


def _v5(model_type: str, name: str) -> str:
    for old, new in _V5_NAMES.get(model_type, ()):
        name = name.replace(old, new)
    return name


def _suffix(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``self_attn.q_proj`` (the path inside the layer)."""
    return _LAYER.sub("", name)


def sites(model_type: str, c: families.Config, rows) -> list[Site]:
    """Every adapter the model's rows allow (table.expand's rows: megatron names, HF names, kind)."""
    out, stacks, base = [], {}, {}
    moved = _PEFT_MOVES.get(model_type, set())
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
            if len(mgs) == 1 and kind in _PARTS:
                for h, part in zip(hfs, _PARTS[kind]):
                    out.append(Site(peft=h[: -len(".weight")], module=modules[0], part=part, kind=kind,
                                    hf_weight=h, per_expert=True))
            continue
        for h, part in zip(hfs, _PARTS[kind]):
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


def _param(module: str, part: str, factor: str) -> str:
    return f"{module}.lora.{part}.lora_{factor}.weight"


# ---------------------------------------------------------------------------------------------
# peft's stacked-expert factors <-> each expert's linear factors
# ---------------------------------------------------------------------------------------------
def _unstack(a: torch.Tensor, b: torch.Tensor, experts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """peft's A [r*E, x], B [y, r*E] -> each expert's (A_e [r, x], B_e [y, r])."""
    rank = a.shape[0] // experts
    a3, b3 = a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts)
    return [(a3[e], b3[:, :, e]) for e in range(experts)]


def _stack(pairs: list) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.cat([p[0] for p in pairs], 0)
    b = torch.stack([p[1] for p in pairs], -1).flatten(1)
    return a.contiguous(), b.contiguous()


def _to_linear(spec: Stacked, a_e, b_e, fc: int):
    """One expert's peft factors -> its megatron linear's (A [r, in], B [out, r]); fc1's B rows as
    megatron holds them ([gate; up])."""
    # peft's delta is B_e A_e in the parameter's layout when it swaps, its transpose otherwise; the
    # linear's weight is the parameter or its transpose
    if spec.peft_swaps == spec.transposed:
        a_e, b_e = b_e.t(), a_e.t()
    if fc == 1 and spec.halves == "interleave":
        b_e = torch.cat([b_e[0::2], b_e[1::2]], 0)
    return a_e.contiguous(), b_e.contiguous()


def _from_linear(spec: Stacked, a, b, fc: int):
    if fc == 1 and spec.halves == "interleave":
        gate, up = b.chunk(2, 0)
        b = torch.stack([gate, up], 1).flatten(0, 1)
    if spec.peft_swaps == spec.transposed:
        a, b = b.t(), a.t()
    return a.contiguous(), b.contiguous()


def _block_diagonal(a: torch.Tensor, b: torch.Tensor, rank: int):
    """A rank-2r fc1 adapter whose B is block-diagonal ([B_gate 0; 0 B_up]) -> its (gate, up) pairs,
    or None."""
    f = b.shape[0] // 2
    if a.shape[0] != 2 * rank or b[:f, rank:].any() or b[f:, :rank].any():
        return None
    return (a[:rank], b[:f, :rank]), (a[rank:], b[f:, rank:])


# ---------------------------------------------------------------------------------------------
# the adapter directory
# ---------------------------------------------------------------------------------------------
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


def _pattern_value(patterns: dict, name: str, default):
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


# ---------------------------------------------------------------------------------------------
# import
# ---------------------------------------------------------------------------------------------
def _base_shapes(hf_dir: str) -> dict:
    return {name: shape for name, (_, shape, _) in hfdir.tensors(hf_dir).items()}


def _hf_rows(model_type: str, c: families.Config, shapes: dict) -> list:
    """The family's table filled in for the layers and experts whose HF tensors the base has."""
    return [row for row in table.rows(model_type, c) if all(h in shapes for h in row[1])]


def _keys(site: Site, stacked_targets: dict) -> list[tuple[str, str]]:
    """(peft key of A, of B) for each name peft may have given the site."""
    if site.experts:
        module, _, param = site.peft.rpartition(".")
        order = stacked_targets.get(module, [param])
        nested = "base_layer." * (len(order) - 1 - order.index(param)) if param in order else ""
        return [(f"{PREFIX}{module}.{nested}lora_A.weight", f"{PREFIX}{module}.{nested}lora_B.weight")]
    names = [site.peft, *site.aliases]
    return [(f"{PREFIX}{n}.lora_A.weight", f"{PREFIX}{n}.lora_B.weight") for n in names]


def _stacked_targets(cfg: dict, all_sites: list[Site]) -> dict:
    """{experts module: its targeted stacked parameters in the module's order (fc1, then fc2)}: peft
    nests one ParamWrapper per parameter, the first one innermost (``base_layer.`` once per wrapper
    around it)."""
    wanted = cfg.get("target_parameters") or []
    out = {}
    for site in sorted((s for s in all_sites if s.experts), key=lambda s: (s.peft.rpartition(".")[0], s.fc)):
        if any(site.peft == t or site.peft.endswith("." + t) for t in wanted):
            module, _, param = site.peft.rpartition(".")
            out.setdefault(module, []).append(param)
    return out


def read_adapter(peft_dir: str, model_type: str, c: families.Config, hf_dir: str) -> tuple[Adapter, list, bool]:
    """The peft adapter in our parameter names, checked against the base's shapes, before anything is
    written: (adapter, the target paths it covers, whether the routed experts' fc1 adapters are fused)."""
    from safetensors import safe_open

    cfg = read_config(peft_dir)
    flag = f"--peft={peft_dir}"
    shapes = _base_shapes(hf_dir)
    all_sites = sites(model_type, c, _hf_rows(model_type, c, shapes))
    stacked_targets = _stacked_targets(cfg, all_sites)
    rank, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    scale = scale_of(alpha, rank, rslora)
    adapter = Adapter(rank, alpha, rslora, float(cfg.get("lora_dropout") or 0.0))
    path = os.path.join(peft_dir, WEIGHTS_FILE)
    with safe_open(path, "pt") as f:
        present = set(f.keys())
        by_key = {}
        for site in all_sites:
            for a_key, b_key in _keys(site, stacked_targets):
                by_key[a_key] = (site, a_key, b_key)
        stray = sorted(k for k in present if k not in by_key and k.replace("lora_B", "lora_A") not in by_key)
        if stray:
            raise ConfigError(f"{flag}: {stray[0]}: {_stray_reason(stray[0], shapes)}")
        fused_fc1 = set()
        for a_key in sorted(k for k in present if k in by_key):
            site, _, b_key = by_key[a_key]
            if b_key not in present:
                raise ConfigError(f"{flag}: {a_key} has no {b_key.rsplit('.', 2)[-2]}")
            a, b = f.get_tensor(a_key), f.get_tensor(b_key)
            name = site.peft
            site_rank = int(_pattern_value(cfg.get("rank_pattern"), name, rank))
            site_alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, alpha))
            if site.experts:
                _check_stacked(flag, a_key, b_key, a, b, site, shapes, model_type, site_rank)
                pieces = _unstack(a, b, len(site.experts))
                spec = STACKED[model_type]
                pairs = [_to_linear(spec, a_e, b_e, site.fc) for a_e, b_e in pieces]
            else:
                _check_linear(flag, a_key, b_key, a, b, shapes[site.hf_weight], site_rank)
                pairs = [(a, b)]
            _check_scale(flag, name, scale_of(site_alpha, site_rank, rslora), scale, rank, site_rank, alpha,
                         doubled=bool(site.experts) and site.fc == 1)
            if not site.experts:
                adapter.tensors[_param(site.module, site.part, "A")] = a
                adapter.tensors[_param(site.module, site.part, "B")] = b
                continue
            for module, (a_e, b_e) in zip(site.experts, pairs):
                if site.fc == 2:
                    adapter.tensors[_param(module, "all", "A")], adapter.tensors[_param(module, "all", "B")] = a_e, b_e
                elif site_rank == rank:
                    fused_fc1.add(module)
                    adapter.tensors[_param(module, "all", "A")], adapter.tensors[_param(module, "all", "B")] = a_e, b_e
                else:
                    halves = _block_diagonal(a_e, b_e, rank)
                    if halves is None:
                        raise ConfigError(f"{flag}: {b_key}: rank {site_rank} over gate_up_proj whose B is not "
                                          f"block-diagonal: not two rank-{rank} adapters (gate, up), and one run has "
                                          "one rank")
                    for part, (a_p, b_p) in zip(("gate", "up"), halves):
                        adapter.tensors[_param(module, part, "A")] = a_p.contiguous()
                        adapter.tensors[_param(module, part, "B")] = b_p.contiguous()
    if not adapter.tensors:
        raise ConfigError(f"{flag}: {WEIGHTS_FILE} holds no LoRA tensor of this model")
    covered = sorted({targets.target_path(n.split(".lora.")[0]) for n in adapter.tensors})
    fc1_experts = [n for n in adapter.tensors if ".local_experts." in n and "linear_fc1.lora." in n]
    canonical = any(".lora.gate." in n for n in fc1_experts)
    if fused_fc1 and canonical:  # canonical parts represent a fused adapter exactly: A_gate = A_up = A
        for module in fused_fc1:
            a, b = adapter.tensors.pop(_param(module, "all", "A")), adapter.tensors.pop(_param(module, "all", "B"))
            for part, b_p in zip(("gate", "up"), b.chunk(2, 0)):
                adapter.tensors[_param(module, part, "A")] = a.clone()
                adapter.tensors[_param(module, part, "B")] = b_p.contiguous()
        fused_fc1 = set()
    return adapter, covered, bool(fused_fc1)


def _stray_reason(key: str, shapes: dict) -> str:
    module = key.removeprefix(PREFIX).split(".lora_")[0].replace(".base_layer", "")
    if not key.startswith(PREFIX) or not re.search(r"\.lora_[AB]\.weight$", key):
        return "not a LoRA factor peft writes (lora_A.weight / lora_B.weight)"
    if f"{module}.weight" in shapes or module in shapes:
        return (f"adapts {module}, which megatron_ext's LoRA does not adapt (attention, MLP, routed and shared "
                "expert linears and the router)")
    return f"adapts {module}, which the base model does not have (an adapter of another model?)"


def _check_linear(flag, a_key, b_key, a, b, base_shape, rank) -> None:
    out_f, in_f = base_shape
    if a.dim() != 2 or tuple(a.shape) != (rank, in_f):
        raise ConfigError(f"{flag}: {a_key}: shape {tuple(a.shape)} does not match the base ({rank}, {in_f}) "
                          f"(rank {rank}, the base linear's {in_f} inputs): an adapter of another model?")
    if b.dim() != 2 or tuple(b.shape) != (out_f, rank):
        raise ConfigError(f"{flag}: {b_key}: shape {tuple(b.shape)} does not match the base ({out_f}, {rank}) "
                          f"(the base linear's {out_f} outputs, rank {rank}): an adapter of another model?")


def _check_stacked(flag, a_key, b_key, a, b, site, shapes, model_type, rank) -> None:
    spec = STACKED[model_type]
    experts = len(site.experts)
    if len(site.hf_parts) == 1 and len(shapes[site.hf_parts[0]]) == 3:
        _, d1, d2 = shapes[site.hf_parts[0]]
    else:  # the checkpoint keys the experts one by one (gate and up apart): the stacked shape from one
        out_f, in_f = sum(shapes[h][0] for h in site.hf_parts), shapes[site.hf_parts[0]][1]
        d1, d2 = (in_f, out_f) if spec.transposed else (out_f, in_f)
    a_cols, b_rows = (d2, d1) if spec.peft_swaps else (d1, d2)
    if a.dim() != 2 or a.shape[0] % experts or a.shape[1] != a_cols:
        raise ConfigError(f"{flag}: {a_key}: shape {tuple(a.shape)} does not match the base's {experts} experts of "
                          f"{a_cols} (rank x {experts}, {a_cols}): an adapter of another model?")
    if b.dim() != 2 or b.shape[0] != b_rows or b.shape[1] != a.shape[0]:
        raise ConfigError(f"{flag}: {b_key}: shape {tuple(b.shape)} does not match the base ({b_rows}, "
                          f"{a.shape[0]}): an adapter of another model?")
    if a.shape[0] // experts != rank:
        raise ConfigError(f"{flag}: {a_key}: rank {a.shape[0] // experts} where the config says {rank}")


def _check_scale(flag, name, site_scale, scale, rank, site_rank, alpha, doubled: bool) -> None:
    """One rank and one scale: a stacked gate_up_proj may have rank 2r (gate and up, block-diagonal)."""
    if site_rank != rank and not (doubled and site_rank == 2 * rank):
        raise ConfigError(f"{flag}: {CONFIG_FILE}: rank_pattern: {name} has rank {site_rank}, the others {rank}: "
                          "a LoRA run here has one rank")
    if not math.isclose(site_scale, scale, rel_tol=1e-9):
        raise ConfigError(f"{flag}: {CONFIG_FILE}: alpha_pattern: {name} is scaled {site_scale:g}, the others "
                          f"{scale:g} (alpha {alpha:g}, rank {rank}): a LoRA run here has one scale")


def target_names(covered: list, model_paths: list) -> list:
    """--lora-target-modules naming exactly the covered target paths: a linear's name where every
    module of that name is covered, else each covered path's tail inside the layer."""
    out = []
    for leaf in dict.fromkeys(p.rsplit(".", 1)[-1] for p in covered):
        mine = sorted({p for p in covered if p.rsplit(".", 1)[-1] == leaf})
        if mine == sorted({p for p in model_paths if p.rsplit(".", 1)[-1] == leaf}):
            out.append(leaf)
        else:
            out.extend(p.removeprefix("decoder.layers.") for p in mine)
    return out


def import_peft(hf_dir: str, peft_dir: str, save: str, *, parse) -> str:
    """HF base + peft adapter -> SAVE/base (the base import) and an adapter checkpoint at SAVE whose
    recipe (SAVE/recipe.yaml) carries the LoRA flags; returns that recipe's path."""
    import yaml

    from megatron_ext import platform

    model_type, c = hfdir.read_config(hf_dir)
    adapter, covered, fused = read_adapter(peft_dir, model_type, c, hf_dir)
    platform.setup()  # before megatron-core is imported
    from megatron_ext.training import ckpt_dirs

    if ckpt_dirs.committed_iterations(save):
        raise ConfigError(f"--save={save}: holds checkpoints already; an adapter import writes a new directory")
    base_dir = os.path.join(save, BASE)
    base_recipe = importer.import_hf(hf_dir, base_dir, parse=parse)
    rows = _hf_rows(model_type, c, _base_shapes(hf_dir))
    paths = [targets.target_path(m[0][: -len(".weight")]) for m, _, _ in rows if m[0].endswith(".weight")]
    flags = {"lora_rank": adapter.rank, "lora_alpha": adapter.alpha, "lora_rslora": adapter.rslora,
             "lora_dropout": adapter.dropout, "lora_target_modules": target_names(covered, paths)}
    if fused:
        flags["lora_fused_adapters"] = ["experts.linear_fc1"]
    recipe = os.path.join(save, checkpoint.RECIPE)
    with open(base_recipe) as f:
        text = f.read()
    with open(recipe, "w") as f:
        f.write(text + f"\n# LoRA adapters imported from peft ({os.path.basename(os.path.normpath(peft_dir))}); "
                       f"the base model is {BASE}/\n")
        yaml.safe_dump(flags, f, sort_keys=False)
    with checkpoint.loaded(checkpoint.find(base_dir, recipe), ["--save", save, "--save-interval", "1", "--no-save-optim",
                                                               "--no-save-rng", "--world-size", "1"],
                           parse=parse) as run:
        from megatron_ext import seams

        params = dict(seams.unwrapped(run.model[0]).named_parameters())
        missing = sorted(n for n in adapter.tensors if n not in params)
        if missing:
            raise ConfigError(f"--peft={peft_dir}: the LoRA flags {flags} built no {missing[0]}")
        left_out, cast = set(), set()
        with torch.no_grad():
            for name, p in params.items():
                if ".lora." not in name:
                    continue
                value = adapter.tensors.get(name)
                if value is None:  # a part peft does not adapt: inert, A = B = 0
                    p.zero_()
                    left_out.add(tuple(name.split(".lora.")[0:1] + name.split(".lora.")[1].split(".")[:1]))
                    continue
                if value.dtype != p.dtype:
                    cast.add((value.dtype, p.dtype))
                p.copy_(value)
        run.save(0, weights_only=True)
    for theirs, ours in sorted(cast, key=str):
        print(f"note: the adapter's {str(theirs).removeprefix('torch.')} tensors are held in the model's "
              f"{str(ours).removeprefix('torch.')} (an export writes {str(ours).removeprefix('torch.')})")
    if left_out:
        named = {(s.module, s.part): s.peft for s in sites(model_type, c, rows) if s.module}
        leaves = sorted({_suffix(named.get(key, f"{key[0]}.{key[1]}")).rsplit(".", 1)[-1] for key in left_out})
        print(f"note: {peft_dir} has no adapter on {', '.join(leaves)} where the LoRA flags put one (a part of a fused "
              "linear, or a layer it leaves out): those hold A = B = 0, add nothing, get zero gradients and stay "
              "zero; an export leaves them out")
    return recipe


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def _inert(a: torch.Tensor, b: torch.Tensor) -> bool:
    return not a.any() and not b.any()


def export_peft(load: str, out: str, recipe: str | None = None, overwrite: bool = False, *, parse) -> list[str]:
    """A LoRA run's adapters (any layout, resharded to one process on load) -> OUT/adapter_config.json
    and OUT/adapter_model.safetensors, a fresh directory (with `overwrite` replaced as a whole);
    returns the peft keys written."""
    from safetensors.torch import save_file

    outputs.check_fresh("--peft", out, overwrite, "an adapter export")
    found = checkpoint.find(load, recipe)
    record = found.lora
    if record is None:
        raise ConfigError(f"--load={load}: its newest checkpoint holds no LoRA adapters (a full or imported "
                          "model): export it with --hf")
    with checkpoint.loaded(found, ["--world-size", "1"], parse=parse) as run:
        args = run.args
        model_type, c = checkpoint.hf_config(args, load)
        from megatron_ext import seams

        chunk = seams.unwrapped(run.model[0])
        params = {n: p.detach().cpu() for n, p in chunk.named_parameters() if ".lora." in n}
        base = {n: t for n, t in checkpoint.model_tensors(chunk).items() if ".lora." not in n}
        rows = table.expand(model_type, c, base)
        rank, alpha, rslora = args.lora_rank, record["alpha"], bool(args.lora_rslora)
        tensors, module_names, parameter_names, patterns = {}, [], [], {}
        for site in sites(model_type, c, rows):
            if site.per_expert:
                continue
            if site.experts:
                written = _export_stacked(site, params, rank, STACKED[model_type], c)
                if written is None:
                    continue
                (a, b), site_rank = written
                if site_rank != rank:
                    patterns[site.peft] = site_rank
            else:
                pair = _export_linear(site, params, c)
                if pair is None:
                    continue
                a, b = pair
            tensors.update(_named(site, a, b))
            (parameter_names if site.as_parameter else module_names).append(site)
        if not tensors:
            raise ConfigError(f"--load={load}: every adapter is zero (A = B = 0): nothing to export")
        stacked_targets = _targeted_by_module(parameter_names)
        renamed = {}
        for site in parameter_names:
            if site.experts:
                (a_key, b_key), = _keys(site, stacked_targets)
                renamed[a_key], renamed[b_key] = tensors.pop(f"{PREFIX}{site.peft}.lora_A.weight"), \
                    tensors.pop(f"{PREFIX}{site.peft}.lora_B.weight")
        tensors.update(renamed)
        all_sites = [s for s in sites(model_type, c, rows) if not s.per_expert]
        if getattr(args, "moe_router_enable_expert_bias", False) and args.moe_router_bias_update_rate:
            print("note: the routers' expert bias (--moe-router-enable-expert-bias), which megatron updates from "
                  f"token counts (--moe-router-bias-update-rate={args.moe_router_bias_update_rate:g}), is no part of "
                  "a peft adapter: peft runs with the base's; export --hf for the model as trained")
        config = _config(rank, alpha, rslora, record.get("dropout", 0.0), module_names, parameter_names, all_sites,
                         patterns)
        config["base_model_name_or_path"] = base_model(record)
        with outputs.fresh_directory(out, staged=True) as target:  # swapped in once complete
            save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, os.path.join(target, WEIGHTS_FILE),
                      metadata={"format": "pt"})
            with open(os.path.join(target, CONFIG_FILE), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
    return sorted(tensors)


def base_model(record: dict) -> str | None:
    """What the adapters apply to, as peft names it (base_model_name_or_path): the Hugging Face model
    their base checkpoint was imported from (hfdir.imported_from). None, with a note, for a base that
    is no import: a trained checkpoint (no Hugging Face model holds its weights until it is exported
    with --hf) or the weights --seed drew."""
    root = (record.get("base") or {}).get("path")
    name = hfdir.imported_from(root) if root else None
    if name is None:
        what = f"{root}, a trained checkpoint," if root else "the model --seed drew"
        print(f"note: base_model_name_or_path left null: the adapters' base is {what} not a Hugging Face model "
              "imported as it was published (export the base with --hf and name that directory there)")
    return name


def _named(site: Site, a, b) -> dict:
    return {f"{PREFIX}{site.peft}.lora_A.weight": a, f"{PREFIX}{site.peft}.lora_B.weight": b}


def _export_linear(site: Site, params: dict, c: families.Config):
    """The site's (A, B) from its canonical part, or from the linear's fused adapter (A repeated, B's
    rows of this part); None if the linear has no adapter or the part is inert."""
    a, b = params.get(_param(site.module, site.part, "A")), params.get(_param(site.module, site.part, "B"))
    if a is None and site.part != "all":
        a, fused_b = params.get(_param(site.module, "all", "A")), params.get(_param(site.module, "all", "B"))
        if a is None:
            return None
        parts = _PARTS[site.kind]
        b = table.converted_to_hf(site.kind, [fused_b], c)[parts.index(site.part)]
    if a is None or _inert(a, b):
        return None
    return a.clone(), b.contiguous().clone()


def _export_stacked(site: Site, params: dict, rank: int, spec: Stacked, c: families.Config):
    """((A, B) in peft's stacked layout, its rank) of a layer's experts, or None (no adapter, or every
    expert's inert). fc1: a fused adapter, or gate and up parts with one A, at rank r; else
    block-diagonal at rank 2r."""
    pairs = []
    for module in site.experts:
        a, b = params.get(_param(module, "all", "A")), params.get(_param(module, "all", "B"))
        if a is None and site.fc == 1 and _param(module, "gate", "A") in params:
            (ag, bg), (au, bu) = ((params[_param(module, p, "A")], params[_param(module, p, "B")])
                                  for p in ("gate", "up"))
            pairs.append(((ag, bg), (au, bu)))
            continue
        if a is None:
            return None
        pairs.append(((a, b),))
    if all(_inert(a, b) for pair in pairs for a, b in pair):
        return None
    if all(len(pair) == 1 or torch.equal(pair[0][0], pair[1][0]) for pair in pairs):
        # a fused adapter, or gate and up with one A: peft's rank-r form
        linear = [pair[0] if len(pair) == 1 else (pair[0][0], torch.cat([pair[0][1], pair[1][1]], 0))
                  for pair in pairs]
        site_rank = rank
    else:  # canonical gate and up: block-diagonal, [A_gate; A_up] and [B_gate 0; 0 B_up]
        linear = [(torch.cat([gate[0], up[0]], 0), torch.block_diag(gate[1], up[1])) for gate, up in pairs]
        site_rank = 2 * rank
    return _stack([_from_linear(spec, a, b, site.fc) for a, b in linear]), site_rank


def _targeted_by_module(parameter_sites: list) -> dict:
    out = {}
    for site in sorted((s for s in parameter_sites if s.experts), key=lambda s: (s.peft.rpartition(".")[0], s.fc)):
        module, _, param = site.peft.rpartition(".")
        out.setdefault(module, []).append(param)
    return out


def _config(rank, alpha, rslora, dropout, module_sites, parameter_sites, all_sites, patterns) -> dict:
    """adapter_config.json: target_modules by leaf name where that names exactly the adapted modules,
    else by their path inside the layer; target_parameters by their path inside the layer."""
    modules = []
    for leaf in dict.fromkeys(s.peft.rsplit(".", 1)[-1] for s in module_sites):
        mine = {s.peft for s in module_sites if s.peft.rsplit(".", 1)[-1] == leaf}
        every = {s.peft for s in all_sites if s.peft.rsplit(".", 1)[-1] == leaf}
        modules.extend([leaf] if mine == every else dict.fromkeys(_suffix(n) for n in sorted(mine)))
    parameters = list(dict.fromkeys(_suffix(s.peft) + ("" if s.experts else ".weight") for s in parameter_sites))
    rank_pattern, alpha_pattern = {}, {}
    stacked = {s.peft for s in parameter_sites if s.experts and s.fc == 1}
    if patterns and set(patterns) == stacked and len(set(patterns.values())) == 1:  # every layer's: one entry
        patterns = {_suffix(next(iter(patterns))): next(iter(patterns.values()))}
    for name, site_rank in patterns.items():
        key = re.escape(name)
        rank_pattern[key] = site_rank
        alpha_pattern[key] = alpha * (math.sqrt(site_rank / rank) if rslora else site_rank / rank)
    if parameters and dropout:
        print(f"note: lora_dropout={dropout} written as 0: peft's target_parameters adapters take no dropout")
        dropout = 0.0
    alpha = int(alpha) if float(alpha).is_integer() else alpha  # as peft's own configs write it
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "use_rslora": rslora,
            "lora_dropout": dropout, "target_modules": sorted(modules) or None,
            "target_parameters": sorted(parameters) or None, "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern, "bias": "none", "use_dora": False, "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": None}

