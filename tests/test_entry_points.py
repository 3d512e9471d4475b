"""Every entry point of scripts/ runs as the docs name it: from the repository root, with no PYTHONPATH
and nothing of the test suite; nothing outside tests/ imports the tests."""
from __future__ import annotations

import ast
import concurrent.futures
import glob
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py")))


def imports_of_tests(paths: list[str]) -> list[str]:
    """`import tests...` / `from tests... import` anywhere in these files (lazy imports too)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n == "tests" or n.startswith("tests.") for n in names):
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_nothing_outside_the_tests_imports_them(tmp_path):
    files = [os.path.join(ROOT, f) for f in ("train.py", "arguments.py")]
    for folder in ("megatron_ext", "scripts"):
        files += glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)
    assert len(files) > 100 and imports_of_tests(files) == []
    bad = tmp_path / "bad.py"  # the negative control: a lazy import, as a benchmark had one
    bad.write_text("def make():\n    from tests.training import local_tokenizers\n")
    assert imports_of_tests([str(bad)]) == [f"{os.path.relpath(str(bad), ROOT)}:2"]


def _help(script: str) -> tuple[str, int, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, os.path.relpath(script, ROOT), "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=110)
    return os.path.relpath(script, ROOT), p.returncode, p.stderr


def test_every_script_answers_help_from_the_repository_root_in_a_clean_environment():
    """`python scripts/X.py --help` from the root with an environment of PATH and HOME only: exit 0 and
    no traceback (a script that needs PYTHONPATH, or a module only the test suite has, fails here)."""
    assert len(SCRIPTS) >= 15
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_help, SCRIPTS))
    assert [(name, rc, err.strip().splitlines()[-1:]) for name, rc, err in results
            if rc != 0 or "Traceback" in err] == []
