"""LoRA adapters in and out of peft's format (``adapter_config.json`` + ``adapter_model.safetensors``).

    import_peft(hf_dir, peft_dir, save)   the base imported into SAVE/base, the adapters into an adapter
                                          checkpoint at SAVE (its recipe: the base's plus the LoRA flags)
    export_peft(load, out)                a LoRA run's adapters -> a directory PeftModel.from_pretrained loads

peft names an adapter by the Hugging Face module it adapts (``base_model.model.`` + the module path +
``.lora_A.weight`` / ``.lora_B.weight``), and those names come from the family's weight table
(weight_tables.py): a row's megatron linear and HF names give each adapter part its peft module (``q``, ``k``,
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

    adapter_config.py  sites.py  factors.py   the config checks, the names on both sides, the tensor math
    importing.py  exporting.py                 import, export
"""
from megatron_ext.hf.peft.exporting import export_peft
from megatron_ext.hf.peft.importing import import_peft

__all__ = ["import_peft", "export_peft"]
