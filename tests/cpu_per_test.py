"""A pytest plugin: the CPU seconds each test costs the machine, the pool workers and the processes it
starts included (JUnit's `time` is wall time, which grows with what runs beside a test).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not matrix" \\
        tests -p tests.cpu_per_test --cpu-per-test cpu.jsonl

appends one JSON line per test, {"id", "cpu", "wall", "end", "process"} (the time it ended, the test
process that ran it: a run's timeline), to the file (every xdist worker appends its own
lines). A test's CPU is the change, over its setup, call and teardown, of the CPU time of the test
process's tree as /proc shows it: every live descendant's own time plus what each live process has
collected from the children it reaped. A pool worker is a child of its fork server, which reaps it, so a
worker that dies during a test still counts. CPU a test leaves running after it ends (a process it
started and did not wait for) is charged to the test that is running when it is collected."""
from __future__ import annotations

import json
import os
import time

import pytest

_HZ = os.sysconf("SC_CLK_TCK")


def _stat(pid: int):
    """(parent pid, own CPU ticks, reaped children's CPU ticks) of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read()
    except OSError:
        return None
    rest = fields[fields.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(rest[1]), int(rest[11]) + int(rest[12]), int(rest[13]) + int(rest[14])


def tree_cpu(root: int | None = None) -> float:
    """CPU seconds of ``root``'s process tree (this process by default), as defined above."""
    procs = {pid: s for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if (s := _stat(pid))}
    children: dict[int, list[int]] = {}
    for pid, (parent, _own, _reaped) in procs.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0, [os.getpid() if root is None else root]
    while stack:
        pid = stack.pop()
        if pid in procs:
            total += procs[pid][1] + procs[pid][2]
            stack.extend(children.get(pid, ()))
    return total / _HZ


def pytest_addoption(parser):
    parser.addoption("--cpu-per-test", metavar="FILE", help="append each test's CPU seconds to FILE (JSON lines)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = item.config.getoption("cpu_per_test")
    if not path:
        yield
        return
    cpu, wall = tree_cpu(), time.monotonic()
    yield
    line = json.dumps({"id": item.nodeid, "cpu": round(tree_cpu() - cpu, 3), "wall": round(time.monotonic() - wall, 3),
                       "end": round(time.time(), 3), "process": os.getpid()})
    with open(path, "a") as f:
        f.write(line + "\n")
