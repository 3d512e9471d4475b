"""The planner's options, declared once: train.py and recipes spell them ``--plan-NAME`` /
``plan_NAME:``, scripts/plan.py ``--NAME``. A leaf: the argument table imports it without the
planner itself."""
from __future__ import annotations

# name: argparse keywords. train.py / recipes: --plan-NAME / plan_NAME; scripts/plan.py: --NAME
OPTIONS = {
    "gpu": dict(default="h100", metavar="GPU",
                help="GPU the plan is for: a100, h100, h200, b200, gb200 (megatron_ext/planner/hardware.py)."),
    "memory-gb": dict(type=float, default=None, metavar="GIB",
                      help="Device memory budget per GPU in GiB (default: the GPU's memory less 10%% reserve)."),
    "host-link-gbps": dict(type=float, default=None, metavar="GBPS",
                           help="Host link bandwidth per GPU in GB/s, each direction (default: the GPU's PCIe)."),
    "search-parallelism": dict(action="store_true",
                               help="Also search the TP/PP/VPP/EP/micro-batch split for the run's world size."),
    "json": dict(action="store_true", help="Print the plan as one JSON object."),
    "png": dict(default=None, metavar="FILE",
                help="Also draw per stage memory by component, as given and with the chosen configuration."),
    "top": dict(type=int, default=5, metavar="N", help="How many candidates to print."),
    "gpus-per-node": dict(type=int, default=8, metavar="N",
                          help="GPUs per node of the cluster: the launch printed for the winner (torchrun "
                          "--nnodes / --nproc-per-node, the slurm template's nodes and GPUS_PER_NODE). "
                          "A GB200 NVL72 compute tray has 4."),
}


def add_arguments(parser, prefix: str = "--plan-"):
    """Declare the planner's options (``--plan`` and ``OPTIONS``) on ``parser``; their dests are
    ``plan_NAME`` whatever the spelling."""
    g = parser.add_argument_group("megatron_ext: planner", "predict each stage's peak memory and the step time; "
                                  "choose offload / recompute / layout for a budget (docs/planner.md)")
    g.add_argument("--plan", action="store_true",
                   help="Print the plan for this recipe and flags instead of training (same as scripts/plan.py).")
    for name, kw in OPTIONS.items():
        g.add_argument(prefix + name, dest="plan_" + name.replace("-", "_"), **kw)
    return parser
