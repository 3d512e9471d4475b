"""A LoRA run's adapters out in peft's format (``export_peft``)."""
from __future__ import annotations

import json
import math
import os
import re

import torch

from megatron_ext.errors import ConfigError
from megatron_ext.hf import checkpoint, families, hfdir, outputs, table
from megatron_ext.hf.peft.factors import from_linear, inert, stack
from megatron_ext.hf.peft.sites import (
    CONFIG_FILE,
    PARTS,
    PREFIX,
    STACKED,
    WEIGHTS_FILE,
    Site,
    Stacked,
    layer_suffix,
    param_name,
    peft_keys,
    sites,
)


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
                (a_key, b_key), = peft_keys(site, stacked_targets)
                renamed[a_key], renamed[b_key] = tensors.pop(f"{PREFIX}{site.peft}.lora_A.weight"), \
                    tensors.pop(f"{PREFIX}{site.peft}.lora_B.weight")
        tensors.update(renamed)
        all_sites = [s for s in sites(model_type, c, rows) if not s.per_expert]
        if args.moe_router_enable_expert_bias and args.moe_router_bias_update_rate:
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
    a, b = params.get(param_name(site.module, site.part, "A")), params.get(param_name(site.module, site.part, "B"))
    if a is None and site.part != "all":
        a, fused_b = params.get(param_name(site.module, "all", "A")), params.get(param_name(site.module, "all", "B"))
        if a is None:
            return None
        parts = PARTS[site.kind]
        b = table.converted_to_hf(site.kind, [fused_b], c)[parts.index(site.part)]
    if a is None or inert(a, b):
        return None
    return a.clone(), b.contiguous().clone()


def _export_stacked(site: Site, params: dict, rank: int, spec: Stacked, c: families.Config):
    """((A, B) in peft's stacked layout, its rank) of a layer's experts, or None (no adapter, or every
    expert's inert). fc1: a fused adapter, or gate and up parts with one A, at rank r; else
    block-diagonal at rank 2r."""
    pairs = []
    for module in site.experts:
        a, b = params.get(param_name(module, "all", "A")), params.get(param_name(module, "all", "B"))
        if a is None and site.fc == 1 and param_name(module, "gate", "A") in params:
            (ag, bg), (au, bu) = ((params[param_name(module, p, "A")], params[param_name(module, p, "B")])
                                  for p in ("gate", "up"))
            pairs.append(((ag, bg), (au, bu)))
            continue
        if a is None:
            return None
        pairs.append(((a, b),))
    if all(inert(a, b) for pair in pairs for a, b in pair):
        return None
    if all(len(pair) == 1 or torch.equal(pair[0][0], pair[1][0]) for pair in pairs):
        # a fused adapter, or gate and up with one A: peft's rank-r form
        linear = [pair[0] if len(pair) == 1 else (pair[0][0], torch.cat([pair[0][1], pair[1][1]], 0))
                  for pair in pairs]
        site_rank = rank
    else:  # canonical gate and up: block-diagonal, [A_gate; A_up] and [B_gate 0; 0 B_up]
        linear = [(torch.cat([gate[0], up[0]], 0), torch.block_diag(gate[1], up[1])) for gate, up in pairs]
        site_rank = 2 * rank
    return stack([from_linear(spec, a, b, site.fc) for a, b in linear]), site_rank


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
        modules.extend([leaf] if mine == every else dict.fromkeys(layer_suffix(n) for n in sorted(mine)))
    parameters = list(dict.fromkeys(layer_suffix(s.peft) + ("" if s.experts else ".weight") for s in parameter_sites))
    rank_pattern, alpha_pattern = {}, {}
    stacked = {s.peft for s in parameter_sites if s.experts and s.fc == 1}
    if patterns and set(patterns) == stacked and len(set(patterns.values())) == 1:  # every layer's: one entry
        patterns = {layer_suffix(next(iter(patterns))): next(iter(patterns.values()))}
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

