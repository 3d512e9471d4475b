"""The sections of ``scripts/gpu_check.py`` (its docstring says what each checks), in the order it runs
them: each is ``section_<name>(size, claims) -> dict``, run at ``size`` (the harness's SIZES), appending
its claims."""
from __future__ import annotations

from gpu_check_sections.cuda_facts import section_cuda_facts
from gpu_check_sections.moe_graphs import section_moe_graphs
from gpu_check_sections.moe_layer import section_moe_layer
from gpu_check_sections.multihot import section_multihot
from gpu_check_sections.offload import section_offload
from gpu_check_sections.planner import section_planner
from gpu_check_sections.train_script import section_train
from gpu_check_sections.transformer_engine import section_transformer_engine


SECTIONS = ("cuda_facts", "multihot", "moe_layer", "moe_graphs", "offload", "train", "planner", "transformer_engine")
RUNNERS = {"cuda_facts": section_cuda_facts, "multihot": section_multihot, "moe_layer": section_moe_layer,
           "moe_graphs": section_moe_graphs,
           "offload": section_offload, "train": section_train, "planner": section_planner,
           "transformer_engine": section_transformer_engine}
