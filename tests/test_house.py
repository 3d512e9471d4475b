"""The house's shape, read from the code's own imports: no import circle, arrows run down the floors
below (an upward one says why in a comment at the import), and the planner is built on the runtime's
vocabulary, never on the measurement package."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_LEVEL = ("train",)

# Floors, lowest first: a module may import from its own floor and the floors below it.
FLOORS = (
    ("megatron_ext", "megatron_ext.errors", "megatron_ext.patching", "megatron_ext.counters"),
    ("megatron_ext.platform",),
    ("megatron_ext.seams", "megatron_ext.config"),
    ("megatron_ext.moe", "megatron_ext.offload", "megatron_ext.schedules", "megatron_ext.lora"),
    ("megatron_ext.training",),
    ("megatron_ext.measure",),
    ("megatron_ext.planner",),
    ("megatron_ext.arguments",),
    ("train", "megatron_ext.hf"),
    ("megatron_ext.bench",),
)


def _modules() -> dict:
    found = {name: os.path.join(ROOT, name + ".py") for name in TOP_LEVEL}
    for folder, _, files in os.walk(os.path.join(ROOT, "megatron_ext")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: str, modules: dict):
    """(imported module, line) for each import of a project module, lazy ones included. Importing
    one's own package (a parent's __init__) is how Python loads a submodule: not an arrow."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                yield target, node.lineno


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


def test_no_import_circle():
    """An arrow up a floor, said why at the import and made inside a function (so it runs after
    every module is loaded), is the one exception; every other arrow counts."""
    modules, imports = _graph()
    allowed = {(name, target) for name, _, target, said, eager in _upward(modules, imports) if said and not eager}
    edges = {name: {t for t, _ in found if (name, t) not in allowed} for name, found in imports.items()}
    assert _cycles(edges) == []


def test_negative_control_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_arrows_run_down_or_say_why():
    modules, imports = _graph()
    unexplained = [f"{name}:{lineno} -> {target}" for name, lineno, target, said, eager in _upward(modules, imports)
                   if not said or eager]
    assert unexplained == []


def test_planner_does_not_import_the_measurement_package():
    _, imports = _graph()
    planner_to_bench = [f"{name} -> {target}" for name, found in imports.items() if name.startswith("megatron_ext.planner")
                        for target, _ in found if target.startswith("megatron_ext.bench")]
    assert planner_to_bench == []
