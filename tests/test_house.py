"""The house's shape, read from the code's own imports: no import circle, arrows run down the floors
below (an upward one says why in a comment at the import), and the planner is built on the runtime's
vocabulary, never on the measurement package."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = ("train", "arguments")  # the rooms at the repository's top: the entry point and its argument layer
WALKED = (("megatron_ext", ROOT), (os.path.join("scripts", "bench"), os.path.join(ROOT, "scripts")))

# Floors, lowest first: a module may import from its own floor and the floors below it.
FLOORS = (
    ("megatron_ext", "megatron_ext.errors", "megatron_ext.patching", "megatron_ext.counters"),
    ("megatron_ext.platform",),
    ("megatron_ext.attention.kernels",),  # pure torch, below the seam that runs it (seams/attention.py)
    ("megatron_ext.seams", "megatron_ext.config"),
    ("megatron_ext.moe", "megatron_ext.offload", "megatron_ext.schedules", "megatron_ext.sft", "megatron_ext.lora",
     "megatron_ext.attention", "megatron_ext.fp8"),
    ("megatron_ext.training",),
    ("megatron_ext.measure",),
    ("megatron_ext.planner",),
    ("megatron_ext.hf",),
    ("arguments",),  # the entry points' argument layer: no package module imports it (Run is handed its parse)
    ("train",),
    ("bench",),  # the benchmarks' helpers, scripts/bench/, beside the scripts that use them
)


def _modules() -> dict:
    """module name -> file, for every .py file the guard walks: the top level's rooms, megatron_ext/, and
    scripts/bench/ (imported as `bench`)."""
    found = {name: os.path.join(ROOT, name + ".py") for name in TOP_LEVEL}
    for top, base in WALKED:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(folder, f)
                name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


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


def _graph():
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


def _said_why(lines: list, lineno: int) -> bool:
    return "#" in lines[lineno - 1] or lines[lineno - 2].strip().startswith("#")


def _upward(modules: dict, imports: dict) -> list:
    """(module, line, target, said why, at import time) for every arrow running up a floor."""
    found = []
    for name, targets in imports.items():
        lines, eager = open(modules[name]).read().splitlines(), _import_time_lines(modules[name])
        for target, lineno in sorted(set(targets)):
            if _floor(target) > _floor(name):
                found.append((name, lineno, target, _said_why(lines, lineno), lineno in eager))
    return found


def _floor(name: str) -> int:
    best = None
    for level, rooms in enumerate(FLOORS):
        for room in rooms:
            if (name == room or name.startswith(room + ".")) and (best is None or len(room) > len(best[1])):
                best = (level, room)
    assert best is not None, f"{name}: on no floor of tests/test_house.py's FLOORS"
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


MAX_UPWARD = 3  # imports running up a floor, each made inside a function and said why at the import


def test_every_file_is_a_room():
    """The guard sees every module: one per .py file under the walked folders (counted here on their
    own, by glob), the top level's rooms included, so its picture can never silently shrink."""
    import glob

    files = {os.path.join(ROOT, name + ".py") for name in TOP_LEVEL}
    for top, _ in WALKED:
        files |= set(glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True))
    modules = _modules()
    assert all(os.path.isfile(os.path.join(ROOT, name + ".py")) for name in TOP_LEVEL)
    assert len(modules) == len(files) and set(modules.values()) == files
    assert {"train", "arguments", "megatron_ext.training.run", "bench"} <= set(modules)


def test_no_package_module_imports_the_argument_layer():
    """Top-level arguments.py is the entry points' layer: they hand its parse to the bring-up
    (megatron_ext/training/run.py use_arguments), so a flag added there reaches the package as args."""
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


def test_arrows_run_down_or_say_why():
    modules, imports = _graph()
    upward = _upward(modules, imports)
    unexplained = [f"{name}:{lineno} -> {target}" for name, lineno, target, said, eager in upward if not said or eager]
    assert unexplained == []
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
               os.path.join("megatron_ext", "training", "checkpointing.py"): ("Checkpointer",),
               # the configs megatron builds from the flags, made at parse time so that their own checks
               # refuse before any compute (no model)
               os.path.join("megatron_ext", "training", "command_line.py"): ("core_transformer_config_from_args",),
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
