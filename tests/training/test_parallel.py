"""Model-parallel state can be set up and torn down repeatedly in one process without leaks."""
from __future__ import annotations

from tests.dist import run_distributed


def test_repeated_layouts_do_not_accumulate_process_groups_or_threads():
    first, second = (run_distributed(2, "tests.training.jobs:layout_cycle", cycles=n) for n in (2, 6))
    for a, b in zip(first, second):
        assert b["groups_after"] == a["groups_after"] == 1  # only the default group survives
        assert b["threads_after"] <= a["threads_after"] + 2  # no growth with more cycles
