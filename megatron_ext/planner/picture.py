"""Per pipeline stage, memory by component as stacked bars: the run as given and the chosen
configuration side by side, the budget as a line."""
from __future__ import annotations

GIB = 2**30
STACK = ("parameters", "gradients", "optimizer", "buffers", "activations", "working_set", "moe_dispatch")
COLORS = ("#4c72b0", "#55a868", "#8172b2", "#937860", "#dd8452", "#c44e52", "#da8bc3")


def draw(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before = result["stages"]
    best = result["candidates"][0]
    after = best.stages
    chosen = "chosen" if best.fits else "closest"  # nothing fits: the configuration nearest the budget
    n = len(before)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * n + 3), 4.5))
    width = 0.38
    for side, stages, dx, hatch in (("as given", before, -width / 2, ""), (chosen, after, width / 2, "//")):
        for i, s in enumerate(stages):
            c = s["components"]
            bottom = 0.0
            # what offload removes comes off the activations
            values = dict(c, activations=c["activations"] + c["offload_removed"])
            for k, color in zip(STACK, COLORS):
                v = max(0.0, values[k]) / GIB
                ax.bar(i + dx, v, width, bottom=bottom, color=color, hatch=hatch, edgecolor="white",
                       label=k.replace("_", " ") if (i == 0 and side == "as given") else None)
                bottom += v
            if c["offload_removed"]:
                ax.bar(i + dx, -c["offload_removed"] / GIB, width, bottom=bottom, fill=False, hatch="..",
                       edgecolor="grey", label="offloaded (on the host)" if i == 0 else None)
    ax.axhline(result["budget_bytes"] / GIB, color="black", linestyle="--", label="budget")
    ax.set_xticks(range(n), [f"stage {i}\nleft: as given\nright: {chosen}" for i in range(n)], fontsize=7)
    ax.set_ylabel("GiB per GPU (predicted)")
    ax.set_title(f"{result['layout']} on {result['gpu']}: {chosen} {' '.join(best.flags) or '(as given)'}",
                 fontsize=7, wrap=True)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
