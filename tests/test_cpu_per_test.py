"""tests/cpu_per_test.py: a test's CPU includes the processes it starts; the lines are written only when asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}:\n    pass\n"


def test_a_childs_cpu_counts_once_it_is_reaped():
    """In a process of its own: this one's tree has the suite's fork server, busy with its imports."""
    probe = ("import subprocess, sys\nfrom tests.cpu_per_test import tree_cpu\nbefore = tree_cpu()\n"
             f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.5)!r}], check=True)\n"
             "print(tree_cpu() - before)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert float(done.stdout) >= 0.45  # the child's own half second, collected by its parent


def test_each_test_gets_its_line_only_when_asked(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        f"def test_burns():\n    subprocess.run([sys.executable, '-c', {BURN.format(s=0.4)!r}], check=True)\n"
        "def test_idles():\n    pass\n")
    out = tmp_path / "cpu.jsonl"
    for asked in ([], ["--cpu-per-test", str(out)]):
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_per_test", "-p", "no:xdist",
                               "-o", "addopts=", "--rootdir", str(tmp_path), *asked, str(tmp_path / "test_burn.py")],
                              cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        if not asked:
            assert not out.exists()
    lines = {json.loads(line)["id"].split("::")[1]: json.loads(line) for line in out.read_text().splitlines()}
    assert sorted(lines) == ["test_burns", "test_idles"]
    assert lines["test_burns"]["cpu"] >= 0.35 and lines["test_idles"]["cpu"] < 0.2, lines
    # the timeline: one test process, the second test ended after the first
    assert lines["test_burns"]["process"] == lines["test_idles"]["process"] != os.getpid()
    assert lines["test_burns"]["end"] <= lines["test_idles"]["end"], lines
