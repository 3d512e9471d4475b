"""A peft adapter in: read and checked against the base's shapes before anything is written, then
the base imported and the adapter checkpoint saved (``import_peft``)."""
from __future__ import annotations

import math
import os
import re

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import checkpoint, families, hfdir, importer, table
from megatron_ext.hf.peft.adapter_config import Adapter, pattern_value, read_config
from megatron_ext.hf.peft.factors import block_diagonal, to_linear, unstack
from megatron_ext.hf.peft.sites import (
    BASE,
    CONFIG_FILE,
    PREFIX,
    STACKED,
    WEIGHTS_FILE,
    Site,
    layer_suffix,
    param_name,
    peft_keys,
    scale_of,
    sites,
)
from megatron_ext.lora import targets


def base_shapes(hf_dir: str) -> dict:
    return {name: shape for name, (_, shape, _) in hfdir.tensors(hf_dir).items()}


def hf_rows(model_type: str, c: families.Config, shapes: dict) -> list:
    """The family's table filled in for the layers and experts whose HF tensors the base has."""
    return [row for row in table.rows(model_type, c) if all(h in shapes for h in row[1])]


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
    shapes = base_shapes(hf_dir)
    all_sites = sites(model_type, c, hf_rows(model_type, c, shapes))
    stacked_targets = _stacked_targets(cfg, all_sites)
    rank, alpha, rslora = int(cfg["r"]), float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    scale = scale_of(alpha, rank, rslora)
    adapter = Adapter(rank, alpha, rslora, float(cfg.get("lora_dropout") or 0.0))
    path = os.path.join(peft_dir, WEIGHTS_FILE)
    with safe_open(path, "pt") as f:
        present = set(f.keys())
        by_key = {}
        for site in all_sites:
            for a_key, b_key in peft_keys(site, stacked_targets):
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
            site_rank = int(pattern_value(cfg.get("rank_pattern"), name, rank))
            site_alpha = float(pattern_value(cfg.get("alpha_pattern"), name, alpha))
            if site.experts:
                _check_stacked(flag, a_key, b_key, a, b, site, shapes, model_type, site_rank)
                pieces = unstack(a, b, len(site.experts))
                spec = STACKED[model_type]
                pairs = [to_linear(spec, a_e, b_e, site.fc) for a_e, b_e in pieces]
            else:
                _check_linear(flag, a_key, b_key, a, b, shapes[site.hf_weight], site_rank)
                pairs = [(a, b)]
            _check_scale(flag, name, scale_of(site_alpha, site_rank, rslora), scale, rank, site_rank, alpha,
                         doubled=bool(site.experts) and site.fc == 1)
            if not site.experts:
                adapter.tensors[param_name(site.module, site.part, "A")] = a
                adapter.tensors[param_name(site.module, site.part, "B")] = b
                continue
            for module, (a_e, b_e) in zip(site.experts, pairs):
                if site.fc == 2:
                    adapter.tensors[param_name(module, "all", "A")], adapter.tensors[param_name(module, "all", "B")] = a_e, b_e
                elif site_rank == rank:
                    fused_fc1.add(module)
                    adapter.tensors[param_name(module, "all", "A")], adapter.tensors[param_name(module, "all", "B")] = a_e, b_e
                else:
                    halves = block_diagonal(a_e, b_e, rank)
                    if halves is None:
                        raise ConfigError(f"{flag}: {b_key}: rank {site_rank} over gate_up_proj whose B is not "
                                          f"block-diagonal: not two rank-{rank} adapters (gate, up), and one run has "
                                          "one rank")
                    for part, (a_p, b_p) in zip(("gate", "up"), halves):
                        adapter.tensors[param_name(module, part, "A")] = a_p.contiguous()
                        adapter.tensors[param_name(module, part, "B")] = b_p.contiguous()
    if not adapter.tensors:
        raise ConfigError(f"{flag}: {WEIGHTS_FILE} holds no LoRA tensor of this model")
    covered = sorted({targets.target_path(n.split(".lora.")[0]) for n in adapter.tensors})
    fc1_experts = [n for n in adapter.tensors if ".local_experts." in n and "linear_fc1.lora." in n]
    canonical = any(".lora.gate." in n for n in fc1_experts)
    if fused_fc1 and canonical:  # canonical parts represent a fused adapter exactly: A_gate = A_up = A
        for module in fused_fc1:
            a, b = adapter.tensors.pop(param_name(module, "all", "A")), adapter.tensors.pop(param_name(module, "all", "B"))
            for part, b_p in zip(("gate", "up"), b.chunk(2, 0)):
                adapter.tensors[param_name(module, part, "A")] = a.clone()
                adapter.tensors[param_name(module, part, "B")] = b_p.contiguous()
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
    from megatron_ext.checkpoint import committed_iterations

    if committed_iterations(save):
        raise ConfigError(f"--save={save}: holds checkpoints already; an adapter import writes a new directory")
    base_dir = os.path.join(save, BASE)
    base_recipe = importer.import_hf(hf_dir, base_dir, parse=parse)
    rows = hf_rows(model_type, c, base_shapes(hf_dir))
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
        leaves = sorted({layer_suffix(named.get(key, f"{key[0]}.{key[1]}")).rsplit(".", 1)[-1] for key in left_out})
        print(f"note: {peft_dir} has no adapter on {', '.join(leaves)} where the LoRA flags put one (a part of a fused "
              "linear, or a layer it leaves out): those hold A = B = 0, add nothing, get zero gradients and stay "
              "zero; an export leaves them out")
    return recipe

