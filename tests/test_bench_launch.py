"""megatron_ext.measure.launch.run_world, which the benchmark scripts run their ranks with: every rank's
result comes back in rank order, and the workers' own output goes to stderr so that a script's
--json stdout stays pure JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json
from megatron_ext.measure.launch import run_world
from tests.test_bench_launch import all_reduce_job
print(json.dumps(run_world(2, all_reduce_job, timeout=100, base=10)))
"""


def all_reduce_job(base: int) -> dict:
    import torch

    print("worker output that must not reach the parent's stdout")
    rank = torch.distributed.get_rank()
    t = torch.tensor([float(base + rank)])
    torch.distributed.all_reduce(t)
    return {"rank": rank, "sum": t.item()}


def test_run_world_results_in_rank_order_and_clean_stdout():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == [{"rank": 0, "sum": 21.0}, {"rank": 1, "sum": 21.0}]  # nothing else
    assert "must not reach" in done.stderr
