"""The layering stays true: the core library imports no stage, a stage imports only the
core, and nothing below the orchestrator and the benchmarks imports them.

    onebit_bert  <  data_prep, pretrain, finetune, smoke_data  <  pipeline, bench

Every import of every module counts, including the ones inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CORE = "onebit_bert"
STAGES = ("data_prep", "pretrain", "finetune", "smoke_data")
TOP = ("pipeline", "bench")


def allowed(package: str) -> set[str]:
    """The project packages ``package`` may import (besides itself)."""
    if package == CORE:
        return set()
    if package in STAGES:
        return {CORE}
    if package == "pipeline":
        return {CORE, *STAGES}
    return {CORE, *STAGES, "pipeline"}  # bench


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in ``path`` (relative imports stay
    inside their own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def violations() -> list[str]:
    project = {CORE, *STAGES, *TOP}
    bad = []
    for package in sorted(project):
        for path in sorted((REPO / package).rglob("*.py")):
            for line, imported in project_imports(path):
                if imported in project and imported != package and imported not in allowed(package):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    return bad


def test_every_package_exists():
    for package in (CORE, *STAGES, *TOP):
        assert (REPO / package / "__init__.py").is_file(), package


def test_no_import_points_up_or_sideways():
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\ndef f():\n    from pipeline.experiment import Experiment\n")
    assert project_imports(module) == [(1, "os"), (3, "pipeline")]
    assert "pipeline" not in allowed(CORE) and "pretrain" not in allowed("finetune")


def module_graph(root: Path = REPO) -> dict[str, set[str]]:
    """Module name -> the project modules it imports (at any depth in the file), for every
    module of every project package; ``from pkg import mod`` counts as importing
    ``pkg.mod`` when that module exists."""
    packages = (CORE, *STAGES, *TOP)
    modules = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for package in packages
        for p in (root / package).rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                edges |= submodules
                if node.module in modules and len(submodules) < len(node.names):
                    edges.add(node.module)  # a name the package's __init__ defines
        graph[name] = edges - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported once, from its first
    module in sorted order)."""
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle_between_modules():
    assert import_cycles(module_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
