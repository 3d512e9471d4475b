"""The house's shape, read from the code's own imports of every Python file of the repository: each
module on a floor, no import circle, arrows run down the floors below (an upward one says why, in
words, in a comment at the import), and the planner is built on the runtime's vocabulary, never on the
measurement package."""
from __future__ import annotations

import ast
import functools
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
# Folders whose files the guard does not walk: the environment and what runs write, nothing of the code.
NOT_CODE = {".venv", ".git", "data", "checkpoints", "runs", "build", "__pycache__", ".pytest_cache"}
# A package root is a room of its own __init__ only: its modules each need their floor.
ROOTS = ("megatron_ext",)

# Floors, lowest first: a module may import from its own floor and the floors below it. A room is a
# module, or a package and everything in it (a package root: its __init__ alone). docs/architecture.md
# ("The floors") draws the same floors, top first (test_the_floors_are_drawn_once_in_architecture_md).
FLOORS = (
    ("megatron_ext", "megatron_ext.errors", "megatron_ext.patching", "megatron_ext.counters", "megatron_ext.helptext"),
    ("megatron_ext.platform",),
    ("megatron_ext.attention.kernels", "megatron_ext.attention.context_parallel"),  # pure torch, below the seam
    # that runs them (seams/attention.py)
    ("megatron_ext.seams", "megatron_ext.config"),
    ("megatron_ext.moe", "megatron_ext.offload", "megatron_ext.schedules", "megatron_ext.sft", "megatron_ext.lora",
     "megatron_ext.attention", "megatron_ext.fp8"),
    ("megatron_ext.checkpoint",),  # save, resume, verify: under the run, the conversions and the planner
    ("megatron_ext.training",),
    # the parser's machinery and the checks in stages: with the configuration's tables, above the run's
    # packages whose checks it calls (training.features, training.data)
    ("megatron_ext.config.command_line",),
    ("megatron_ext.measure",),
    ("megatron_ext.planner",),
    ("megatron_ext.hf",),
    ("arguments",),  # the entry points' argument layer: no package module imports it (Run is handed its parse)
    ("train",),
    ("bench", "gpu_check_sections"),  # the benchmarks' and the device check's helpers, beside their scripts
    ("scripts",),  # the scripts of scripts/ (and scripts/slurm/), each an entry point
    ("tests",),
)


def _code_files(root: str = ROOT) -> list:
    """Every .py file of the repository (not the environment or what runs write)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in NOT_CODE and not d.startswith("."))
        found += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def _module_name(path: str, root: str = ROOT) -> str:
    """The name a file is imported by: scripts/ is on sys.path of a script (`python scripts/x.py`), so
    its packages (scripts/bench/, scripts/gpu_check_sections/) go by their own names; a script itself
    by its path (scripts.x, as the tests import one); everything else by its path from the root."""
    rel = os.path.relpath(path, root)[:-3]
    parts = rel.split(os.sep)
    if parts[0] == "scripts" and len(parts) > 2 and os.path.isfile(os.path.join(root, "scripts", parts[1],
                                                                                 "__init__.py")):
        parts = parts[1:]
    return ".".join(parts).removesuffix(".__init__")


def _modules(root: str = ROOT) -> dict:
    """module name -> file, for every .py file of the repository."""
    return {_module_name(path, root): path for path in _code_files(root)}


def _imports(name: str, path: str, modules: dict):
    """(imported module, line) for each import of a project module, lazy ones included. A package
    named in an import is an arrow to its __init__, one's own package too (`from megatron_ext import
    training` inside training/ runs training/__init__.py); the parent packages Python loads on the
    way to a submodule (`from megatron_ext.training import model`: megatron_ext, .training) are not."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            named = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            # `from pkg import name`: an arrow to pkg's __init__ only where a name comes from it
            targets = named + ([base] if len(named) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not _loaded_on_the_way(target, name, node):
                yield target, node.lineno


def _loaded_on_the_way(target: str, name: str, node) -> bool:
    """`import a.b.c` / `from a.b import c` load a and a.b first: those parents are not arrows of
    their own, unless the import names the package itself (`from a import b`, `import a.b as x`)."""
    if isinstance(node, ast.Import):
        return any(a.name.startswith(target + ".") for a in node.names)
    return False


@functools.lru_cache(maxsize=1)
def _graph():
    """(modules, their imports) of the repository, read once per session."""
    modules = _modules()
    return modules, {name: list(_imports(name, path, modules)) for name, path in modules.items()}


def _import_time_lines(path: str) -> set:
    """Lines of the imports that run when the module is imported (not inside a function)."""
    lines, todo = set(), list(ast.parse(open(path).read()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.add(node.lineno)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return lines


# what a comment may hold that is no reason: a linter's or type checker's directive
_DIRECTIVES = re.compile(r"\bnoqa\b(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|\btype:\s*ignore(\[[^\]]*\])?|"
                         r"\bpragma:?\s*no\s*cover\b|\bpylint:\s*\S+|\bfmt:\s*\w+", re.IGNORECASE)


def _reason(comment: str) -> bool:
    """A comment gives a reason: two words or more, once the linters' directives are taken out."""
    return len(re.findall(r"[A-Za-z]{2,}", _DIRECTIVES.sub(" ", comment))) >= 2


def _comment(line: str) -> str:
    """The comment of a source line (a # inside a string is not one)."""
    import io
    import tokenize

    try:
        return next((t.string for t in tokenize.generate_tokens(io.StringIO(line).readline)
                     if t.type == tokenize.COMMENT), "")
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line[line.index("#"):] if "#" in line else ""


def _said_why(lines: list, lineno: int) -> bool:
    """The import's line, or the comment lines right above it, say why in words."""
    said = [_comment(lines[lineno - 1].strip())]
    k = lineno - 2
    while k >= 0 and lines[k].strip().startswith("#"):
        said.append(lines[k].strip())
        k -= 1
    return any(_reason(c) for c in said)


def _upward(modules: dict, imports: dict) -> list:
    """(module, line, target, said why, at import time) for every arrow running up a floor."""
    found = []
    for name, targets in imports.items():
        up = [(target, lineno) for target, lineno in sorted(set(targets)) if _floor(target) > _floor(name)]
        if up:
            lines, eager = open(modules[name]).read().splitlines(), _import_time_lines(modules[name])
            found += [(name, lineno, target, _said_why(lines, lineno), lineno in eager) for target, lineno in up]
    return found


class NoFloor(AssertionError):
    """A module in no room of FLOORS."""


def _floor(name: str, floors=FLOORS) -> int:
    best = None
    for level, rooms in enumerate(floors):
        for room in rooms:
            inside = name == room or (name.startswith(room + ".") and room not in ROOTS)
            if inside and (best is None or len(room) > len(best[1])):
                best = (level, room)
    if best is None:
        raise NoFloor(f"{name}: on no floor of tests/test_house.py's FLOORS (add its room where it belongs)")
    return best[0]


def _cycles(edges: dict) -> list:
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


MAX_UPWARD = 1  # imports running up a floor, each made inside a function and said why at the import


def test_every_file_is_a_room_on_a_floor():
    """The guard sees every Python file of the repository (counted here on their own, by git), each
    module on a floor, so its picture can never silently shrink."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    modules = _modules()
    assert set(modules.values()) == {os.path.join(ROOT, f) for f in listed} and len(modules) == len(listed)
    assert {"train", "arguments", "megatron_ext.training.run", "bench", "bench.offload", "gpu_check_sections",
            "scripts.bench_offload", "scripts.slurm.launch_env", "tests.test_house"} <= set(modules)
    assert [name for name in modules if _floor_or_none(name) is None] == []


def _floor_or_none(name: str, floors=FLOORS):
    try:
        return _floor(name, floors)
    except NoFloor:
        return None


def test_negative_control_a_module_on_no_floor(tmp_path):
    """A new package of megatron_ext (or of scripts/) in no room is on no floor: the package root does
    not take it in."""
    (tmp_path / "megatron_ext" / "newcapability").mkdir(parents=True)
    (tmp_path / "megatron_ext" / "newcapability" / "__init__.py").write_text("from megatron_ext import errors\n")
    (tmp_path / "scripts" / "newhelpers").mkdir(parents=True)
    (tmp_path / "scripts" / "newhelpers" / "__init__.py").write_text("")
    modules = _modules(str(tmp_path))
    assert sorted(modules) == ["megatron_ext.newcapability", "newhelpers"]
    assert [name for name in modules if _floor_or_none(name) is None] == sorted(modules)
    assert _floor("megatron_ext") == 0 and _floor("megatron_ext.training.run") == _floor("megatron_ext.training")


def test_negative_control_an_upward_import(tmp_path):
    """A platform module importing training (up the floors): refused unless a comment says why in words;
    `# noqa`, `# noqa: E402` or a bare `#` are no reason; made at import time, it is refused even so."""
    (tmp_path / "megatron_ext" / "platform").mkdir(parents=True)
    (tmp_path / "megatron_ext" / "training").mkdir(parents=True)
    (tmp_path / "megatron_ext" / "training" / "run.py").write_text("")
    cases = {
        "silent": "def f():\n    from megatron_ext.training import run\n",
        "noqa": "def f():\n    from megatron_ext.training import run  # noqa\n",
        "noqa_code": "def f():\n    from megatron_ext.training import run  # noqa: F401,E402\n",
        "bare": "def f():\n    #\n    from megatron_ext.training import run  #\n",
        "said": "def f():\n    from megatron_ext.training import run  # noqa: F401 (the run's own bring-up)\n",
        "said_above": "def f():\n    # the run's own bring-up, lazily\n    from megatron_ext.training import run\n",
        "eager": "from megatron_ext.training import run  # the run's own bring-up\n",
    }
    for name, source in cases.items():
        (tmp_path / "megatron_ext" / "platform" / f"{name}.py").write_text(source)
    modules = _modules(str(tmp_path))
    imports = {name: list(_imports(name, path, modules)) for name, path in modules.items()}
    upward = {name.rpartition(".")[2]: (said, eager) for name, _, target, said, eager in _upward(modules, imports)
              if target == "megatron_ext.training.run"}
    assert upward == {"silent": (False, False), "noqa": (False, False), "noqa_code": (False, False),
                      "bare": (False, False), "said": (True, False), "said_above": (True, False),
                      "eager": (True, True)}
    assert sorted(_unexplained(_upward(modules, imports))) == sorted(
        f"megatron_ext.platform.{n}:{line} -> megatron_ext.training.run"
        for n, line in (("silent", 2), ("noqa", 2), ("noqa_code", 2), ("bare", 3), ("eager", 1)))


def test_no_package_module_imports_the_argument_layer():
    """Top-level arguments.py is the entry points' layer: they hand its parse to the bring-up
    (megatron_ext/training/run.py ``Run.from_argv(argv, parse=arguments.parse)``), so a flag added
    there reaches the package as args."""
    _, imports = _graph()
    assert [f"{name}:{line}" for name, found in imports.items() if name.startswith("megatron_ext")
            for target, line in found if target == "arguments"] == []


def test_no_import_circle():
    """Every arrow counts, lazy ones (inside a function) and one's own package's __init__ included."""
    _, imports = _graph()
    assert _cycles({name: {t for t, _ in found} for name, found in imports.items()}) == []


def test_negative_control_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_package_importing_its_own_init_is_an_arrow(tmp_path):
    """`from pkg import sibling` inside pkg/ runs pkg/__init__.py: an arrow (the kind of circle
    features -> training -> model -> features was); the parents loaded on the way are not."""
    import ast as ast_

    modules = {"p": "p/__init__.py", "p.a": "p/a.py", "p.b": "p/b.py"}
    own = ast_.parse("from p import b\nfrom p.b import x\nimport p.b\n").body

    def targets(node):
        path = tmp_path / "m.py"
        path.write_text(ast_.unparse(node))
        return [t for t, _ in _imports("p.a", str(path), modules)]

    assert targets(own[0]) == ["p.b"] and targets(own[1]) == ["p.b"] and targets(own[2]) == ["p.b"]
    path = tmp_path / "n.py"
    path.write_text("from p import helper\n")
    assert [t for t, _ in _imports("p.a", str(path), modules)] == ["p"]


def _unexplained(upward: list) -> list:
    return [f"{name}:{lineno} -> {target}" for name, lineno, target, said, eager in upward if not said or eager]


def test_arrows_run_down_or_say_why():
    modules, imports = _graph()
    upward = _upward(modules, imports)
    assert _unexplained(upward) == []
    assert len({(name, lineno) for name, lineno, *_ in upward}) <= MAX_UPWARD, upward


def test_no_sys_path_insert():
    """Scripts and tests import the installed package; none edits sys.path."""
    found = []
    for folder in ("megatron_ext", "scripts", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    for node in ast.walk(ast.parse(open(path).read())):
                        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                and node.func.attr == "insert" and ast.unparse(node.func.value) == "sys.path"):
                            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert found == []


# the steps of a run's bring-up: only training/run.py (Run) calls them
BRING_UP = ("build_chunks", "transformer_config", "initialize_model_parallel", "layer_spec", "_gpt_model",
            "build_optimizer", "build_iterators", "Checkpointer")
# megatron-core's model and its configuration, made only by the builder (training/model.py: the config,
# the layer specs, GPTModel; training/parallel.py: the process groups), which the run calls
MEGATRON_BUILDS = ("GPTModel", "TransformerConfig", "MLATransformerConfig", "core_transformer_config_from_args",
                   "get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec",
                   "get_gpt_decoder_block_spec", "get_gpt_decoder_layer_specs", "get_gpt_mtp_block_spec",
                   "initialize_model_parallel")
BUILDER = {os.path.join("megatron_ext", "training", "model.py"):
           tuple(n for n in MEGATRON_BUILDS if n != "initialize_model_parallel") + ("_gpt_model", "layer_spec"),
           os.path.join("megatron_ext", "training", "parallel.py"): ("initialize_model_parallel",)}


def _calls(path: str):
    """(name, line) of every call: ``f(...)`` and ``x.f(...)`` by the name f."""
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Call):
            yield (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")), node.lineno


def _second_bring_ups(allowed: dict, root: str = ROOT, folders=("megatron_ext", "scripts")) -> list:
    """file:line name of every bring-up step or megatron-core construction a file is not allowed."""
    found = []
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, root)
                    found += [f"{rel}:{line} {name}" for name, line in _calls(path)
                              if name in BRING_UP + MEGATRON_BUILDS and name not in allowed.get(rel, ())]
    return found


def test_one_bring_up():
    """No second copy of the bring-up in the package or the scripts: every run, and every model-only use
    (conversion, the dry-run's key check, the planner's trace, the benchmarks), goes through Run, and
    only the builder constructs megatron-core's model, its config, its layer specs or process groups."""
    allowed = {os.path.join("megatron_ext", "training", "run.py"): BRING_UP,
               **BUILDER,
               # loading before Megatron-FSDP shards the model is the checkpointer's own step
               os.path.join("megatron_ext", "checkpoint", "checkpointer.py"): ("Checkpointer",),
               # the configs megatron builds from the flags, made at parse time so that their own checks
               # refuse before any compute (no model)
               os.path.join("megatron_ext", "config", "command_line.py"): ("core_transformer_config_from_args",),
               # the planner reads the target's layer layout from its config (no model: a cluster's run)
               os.path.join("megatron_ext", "planner", "run.py"): ("core_transformer_config_from_args",),
               # the sync audit builds one MoE layer (the layer spec's MLP submodule), not a model
               os.path.join("megatron_ext", "moe", "audit.py"): ("TransformerConfig", "get_gpt_layer_local_spec")}
    assert _second_bring_ups(allowed) == []


def test_one_bring_up_sees_a_second_construction(tmp_path):
    """The guard's negative control: process groups, a config, a layer spec, a model and the builder's
    private step, each made by hand in a script, are each found."""
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "by_hand.py").write_text(
        "from megatron.core import parallel_state\n"
        "parallel_state.initialize_model_parallel()\n"
        "config = TransformerConfig(num_layers=1)\n"
        "spec = gpt_layer_specs.get_gpt_layer_local_spec()\n"
        "model = GPTModel(config=config, transformer_layer_spec=spec)\n"
        "chunk = model._gpt_model(args, config, spec, None)\n")
    found = _second_bring_ups({}, root=str(tmp_path), folders=("scripts",))
    assert [f.split(" ")[1] for f in found] == ["initialize_model_parallel", "TransformerConfig",
                                                 "get_gpt_layer_local_spec", "GPTModel", "_gpt_model"], found


def test_planner_does_not_import_the_measurement_package():
    _, imports = _graph()
    planner_to_bench = [f"{name} -> {target}" for name, found in imports.items() if name.startswith("megatron_ext.planner")
                        for target, _ in found if target.split(".")[0] == "bench"]
    assert planner_to_bench == []


ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")
# the picture's names of rooms outside megatron_ext/
_OUTSIDE = {"tests/": "tests", "scripts/": "scripts", "scripts/bench/": "bench",
            "scripts/gpu_check_sections/": "gpu_check_sections", "train.py": "train", "arguments.py": "arguments"}


def _room(path: str) -> str:
    """A room as the picture names it: a path under megatron_ext/ (its __init__.py: the root) or one
    of _OUTSIDE."""
    if path in _OUTSIDE:
        return _OUTSIDE[path]
    inner = path.removesuffix("/").removesuffix(".py").replace("/", ".")
    return "megatron_ext" if inner == "__init__" else f"megatron_ext.{inner}"


def drawn_floors(text: str) -> list:
    """The floors of the first fenced picture under "## The floors", lowest first: each line that
    starts in the picture's first column (one space in) is a floor, its leading paths its rooms."""
    section = text.split("## The floors", 1)[1]
    picture = section.split("```", 2)[1]
    floors = []
    for line in picture.splitlines():
        if not line.startswith(" ") or line.startswith("  "):
            continue
        rooms = []
        for word in line.split():
            if not (word.endswith("/") or word.endswith(".py")):
                break
            rooms.append(_room(word))
        floors.append(tuple(rooms))
    return floors[::-1]


def test_the_floors_are_drawn_once_in_architecture_md():
    """docs/architecture.md draws the guard's floors: the same rooms on the same floors, in order."""
    assert [set(rooms) for rooms in drawn_floors(open(ARCHITECTURE).read())] == [set(rooms) for rooms in FLOORS]
    swapped = "## The floors\n\n```\n hf/   up\n planner/   down\n   planner/ a continuation\n```\n"
    assert drawn_floors(swapped) == [("megatron_ext.planner",), ("megatron_ext.hf",)]  # read as drawn
