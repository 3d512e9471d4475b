"""The planner's options, declared once as a typed dataclass (config/typed.py): train.py and recipes
spell them ``--plan-NAME`` / ``plan_NAME:``, scripts/plan.py ``--NAME``; the dests are ``plan_NAME``
either way. A leaf: the argument table imports it without the planner itself."""
from __future__ import annotations

import dataclasses

from megatron_ext.config.domains import Domain
from megatron_ext.config.typed import Options, add_group, option

TITLE = "megatron_ext: planner"
DESCRIPTION = ("predict each stage's peak memory and the step time; choose offload / recompute / layout for a "
               "budget (docs/planner.md)")


@dataclasses.dataclass
class PlanOptions(Options):
    """What a plan is for: the GPU, its memory budget and host link, the node size of the launch, and
    how the plan is printed."""

    PREFIX = "plan_"  # --plan-<field> (scripts/plan.py: --<field>)

    gpu: str = option("h100", metavar="GPU")
    """GPU the plan is for: a100, h100, h200, b200, gb200 (megatron_ext/planner/hardware.py)."""

    memory_gb: float | None = option(None, Domain(float, 0, lo_open=True), "positive", metavar="GIB")
    """Device memory budget per GPU in GiB (default: the GPU's memory less 10% reserve)."""

    host_link_gbps: float | None = option(None, Domain(float, 0, lo_open=True), "positive", metavar="GBPS")
    """Host link bandwidth per GPU in GB/s, each direction (default: the GPU's PCIe)."""

    search_parallelism: bool = False
    """Also search the TP/PP/VPP/EP/micro-batch split for the run's world size; where no split fits, context
    parallelism too (a sequence too long for one GPU)."""

    json: bool = False
    """Print the plan as one JSON object."""

    png: str | None = option(None, metavar="FILE")
    """Also draw per stage memory by component, as given and with the chosen configuration."""

    top: int = option(5, Domain(int, 1), "batch size", metavar="N")
    """How many candidates to print."""

    gpus_per_node: int = option(8, Domain(int, 1), "batch size", metavar="N")
    """GPUs per node of the cluster: the launch printed for the winner (torchrun --nnodes /
    --nproc-per-node, the slurm template's nodes and GPUS_PER_NODE). A GB200 NVL72 compute tray has 4."""


# the options' names as scripts/plan.py spells them after "--" (train.py: after "--plan-")
NAMES = tuple(f.name.replace("_", "-") for f in dataclasses.fields(PlanOptions))


def add_arguments(parser):
    """Declare ``--plan`` and the planner's options, ``--plan-NAME`` (dests ``plan_NAME``), on train.py's
    parser. scripts/plan.py lists them as ``--NAME`` (``add_group_without_torch``, flag prefix "--")."""
    group = add_group(parser, PlanOptions, TITLE, DESCRIPTION)
    group.add_argument("--plan", action="store_true",
                       help="Print the plan for this recipe and flags instead of training (same as scripts/plan.py).")
    group._group_actions.insert(0, group._group_actions.pop())  # listed first: the switch the options serve
    return parser
