"""Every entry point of scripts/ runs as the docs name it: from the repository root, with no PYTHONPATH
and nothing of the test suite; nothing outside tests/ imports the tests."""
from __future__ import annotations

import ast
import glob
import json
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


# One interpreter answers every script's --help, each as `python scripts/X.py --help` from the root would:
# sys.path[0] the script's folder and no current directory on the path; between scripts the path is
# restored and every module loaded from the checkout, but the package and the environment (scripts/bench/,
# arguments.py, the scripts themselves), is forgotten, so each script must find its own. torch and
# megatron-core stay imported: they come from the environment either way (one import of them, not 19).
_HELP_ALL = r"""
import io, json, os, runpy, sys, traceback
root = os.getcwd()
sys.path[:] = [p for p in sys.path if p not in ("", ".", root)]
path, kept = list(sys.path), (os.path.join(root, "megatron_ext") + os.sep, sys.prefix + os.sep)
for script in sys.argv[1:]:
    sys.path[:] = [os.path.join(root, os.path.dirname(script))] + path
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if file.startswith(root + os.sep) and not file.startswith(kept):
            del sys.modules[name]
    sys.argv, err, rc = [script, "--help"], io.StringIO(), 0
    out, sys.stdout, sys.stderr = (sys.stdout, sys.stderr), io.StringIO(), err
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        sys.stdout, sys.stderr = out
    print(json.dumps([script, rc, err.getvalue()]), flush=True)
"""


def _help_all(scripts: list[str], env: dict) -> tuple[subprocess.CompletedProcess, list]:
    """_HELP_ALL over ``scripts`` (paths from the root) in a fresh interpreter: the run and its
    [script, exit status, stderr] per script."""
    done = subprocess.run([sys.executable, "-c", _HELP_ALL, *scripts], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=110)
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]


def test_every_script_answers_help_from_the_repository_root_in_a_clean_environment():
    """`python scripts/X.py --help` from the root with an environment of PATH and HOME only: exit 0 and
    no traceback (a script that needs PYTHONPATH, or a module only the test suite has, fails here)."""
    assert len(SCRIPTS) >= 15
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "OMP_NUM_THREADS": "1"}
    scripts = [os.path.relpath(script, ROOT) for script in SCRIPTS]
    done, results = _help_all(scripts, env)
    assert done.returncode == 0 and [name for name, _, _ in results] == scripts, done.stderr[-3000:]
    assert [(name, rc, err.strip().splitlines()[-1:]) for name, rc, err in results
            if rc != 0 or "Traceback" in err] == []


def test_a_script_that_needs_the_checkout_on_its_path_fails_there(tmp_path):
    """The negative control: a script importing the test suite with no path set-up of its own fails, though
    the script before it put the root on its path and imported the suite (its path and modules are gone).
    The two scripts live outside the checkout: a file in scripts/ would be seen by the tests that list it."""
    made = []
    for i, body in enumerate((f"import sys\nsys.path.insert(0, {ROOT!r})\nimport tests.scripts\n",
                              "import tests.scripts\n")):
        (tmp_path / f"control_{i}.py").write_text(body)
        made.append(str(tmp_path / f"control_{i}.py"))
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    names = [os.path.relpath(name, ROOT) for name in made]
    done, results = _help_all(names, env)
    assert [(name, rc) for name, rc, _ in results] == [(names[0], 0), (names[1], 1)], done.stderr[-3000:]
    assert "ModuleNotFoundError: No module named 'tests'" in results[1][2]
