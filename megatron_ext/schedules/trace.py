"""Timeline of one recorded step: Chrome trace (chrome://tracing, Perfetto) and a PNG.

Rows per rank: compute of the forward micro-batch, compute of the backward micro-batch, TP
communication in flight (issue -> completion seen by the communication library) and the time the
host was blocked waiting on it (the exposed part).
"""
from __future__ import annotations

import json


def to_dicts(rec, t0: float) -> dict:
    """A recorder's step, as plain data relative to t0 (seconds)."""
    return {
        "segments": [(s.owner, s.lane, s.t0 - t0, s.t1 - t0) for s in rec.segments if s.t1 > s.t0],
        "collectives": [
            (c.op, c.group, c.owner, c.lane, c.t_issue - t0, c.t_wait0 - t0, c.t_wait1 - t0,
             max(c.t_done, c.t_issue) - t0, c.nbytes)
            for c in rec.collectives
        ],
    }


def _row(owner: str) -> str:
    return "compute: forward" if owner.startswith("F") else "compute: backward"


def chrome_trace(steps: dict, path: str) -> None:
    """steps: {"plain": {rank: to_dicts(...)}, "ours": {...}} -> one JSON trace file."""
    events = []
    pid = 0
    for schedule, ranks in steps.items():
        for rank, data in sorted(ranks.items()):
            pid += 1
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"{schedule} schedule, rank {rank}"}})
            for tid, name in enumerate(["compute: forward", "compute: backward", "TP comm in flight",
                                        "blocked on TP comm"]):
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": name}})
            for owner, lane, a, b in data["segments"]:
                events.append({"ph": "X", "name": owner, "pid": pid,
                               "tid": 0 if owner.startswith("F") else 1,
                               "ts": a * 1e6, "dur": (b - a) * 1e6, "args": {"lane": lane}})
            for op, group, owner, lane, ti, w0, w1, done, nbytes in data["collectives"]:
                if group != "tp":
                    continue
                events.append({"ph": "X", "name": f"{op} ({owner})", "pid": pid, "tid": 2,
                               "ts": ti * 1e6, "dur": max(done - ti, 1e-7) * 1e6,
                               "args": {"bytes": nbytes, "issued_by": owner}})
                if w1 > w0:
                    events.append({"ph": "X", "name": f"wait {op} ({owner})", "pid": pid, "tid": 3,
                                   "ts": w0 * 1e6, "dur": (w1 - w0) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def png(steps: dict, path: str, rank: int = 0, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(steps)
    end = max(
        max([b for *_, b in d["segments"]] + [x[7] for x in d["collectives"]] + [0.0])
        for s in names for r, d in steps[s].items() if r == rank
    )
    fig, axes = plt.subplots(len(names), 1, figsize=(14, 2.3 * len(names) + 0.6), sharex=True)
    rows = ["compute: forward", "compute: backward", "TP comm in flight", "blocked on TP comm"]
    colors = {"F": "#4c72b0", "B": "#dd8452"}
    for ax, name in zip(axes, names):
        data = steps[name][rank]
        for owner, lane, a, b in data["segments"]:
            y = rows.index(_row(owner))
            ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (y - 0.4, 0.8),
                           facecolors=colors[owner[0]], edgecolor="white", linewidth=0.3)
            if (b - a) * 1e3 > end * 1e3 / 60:
                ax.text((a + b) / 2 * 1e3, y, owner, ha="center", va="center", fontsize=6, color="white")
        for op, group, owner, lane, ti, w0, w1, done, nbytes in data["collectives"]:
            if group != "tp":
                continue
            ax.broken_barh([(ti * 1e3, max(done - ti, 0) * 1e3)], (2 - 0.35, 0.7),
                           facecolors=colors.get(owner[:1], "#777777"), alpha=0.45)
            if w1 > w0:
                ax.broken_barh([(w0 * 1e3, (w1 - w0) * 1e3)], (3 - 0.4, 0.8), facecolors="#c44e52")
        exposed = sum(x[6] - x[5] for x in data["collectives"] if x[1] == "tp")
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{name} schedule, rank {rank}: blocked on TP comm {exposed * 1e3:.1f} ms", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms since step start")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
