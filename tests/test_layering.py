"""The layering stays true: the core library imports no stage, a stage imports only the
core, and nothing below the orchestrator and the benchmarks imports them.

    onebit_bert  <  data_prep, pretrain, finetune, smoke_data  <  pipeline, bench

In tests/, no file imports a test module (a ``test_*`` module in any folder below tests/):
what several test modules share lives in tests/helpers/.

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


def imported_test_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path`` of a test module (``tests.test_*``, also in
    a folder: ``tests.core.optim.test_*``), at any depth in the file: ``import tests.test_x``,
    ``from tests.test_x import f``, ``from tests import test_x`` and their relative forms,
    resolved from the package that ``path`` is in below ``root``."""
    package = path.relative_to(root).parent.parts

    def test_module_of(parts: list[str]) -> str | None:
        """``tests[.<folder>...].test_x`` of a module path below tests/, else None."""
        if parts[:1] != ["tests"]:
            return None
        for depth, part in enumerate(parts[1:], start=2):
            if part.startswith("test_"):
                return ".".join(parts[:depth])
        return None

    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = base + (node.module.split(".") if node.module else [])
            if test_module_of(module):
                modules = [module]
            else:  # from tests import test_x
                modules = [[*module, alias.name] for alias in node.names]
        else:
            continue
        found += [(node.lineno, test_module_of(m)) for m in modules if test_module_of(m)]
    return found


def imports_of_test_modules() -> list[str]:
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for line, imported in imported_test_modules(path):
            bad.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    return bad


def test_no_file_in_tests_imports_a_test_module():
    assert imports_of_test_modules() == []


def test_the_test_import_check_sees_a_violation(tmp_path):
    helpers = tmp_path / "tests" / "helpers"
    helpers.mkdir(parents=True)
    module = helpers / "m.py"
    module.write_text(
        "import os\n"
        "import tests.test_a\n"
        "from tests.test_b import f\n"
        "from tests import corpus, test_c\n"
        "from tests.helpers.runs import tiny_config\n"
        "def g():\n"
        "    from ..test_d import h\n"
        "    from .. import test_e\n"
    )
    assert imported_test_modules(module, root=tmp_path) == [
        (2, "tests.test_a"),
        (3, "tests.test_b"),
        (4, "tests.test_c"),
        (7, "tests.test_d"),
        (8, "tests.test_e"),
    ]
    beside = tmp_path / "tests" / "test_m.py"
    beside.write_text("from .test_pretrain import tiny_config\nfrom .toy import build_model\n")
    assert imported_test_modules(beside, root=tmp_path) == [(1, "tests.test_pretrain")]
    nested = tmp_path / "tests" / "core" / "optim" / "test_m.py"
    nested.parent.mkdir(parents=True)
    nested.write_text(
        "from tests.core.optim.test_lamb import f\n"
        "from ..strategies import test_diloco\n"
        "import tests.stages.test_pretrain.sub\n"
        "from tests.helpers.toy import build_model\n"
        "from . import toy_helpers\n"
    )
    assert imported_test_modules(nested, root=tmp_path) == [
        (1, "tests.core.optim.test_lamb"),
        (2, "tests.core.strategies.test_diloco"),
        (3, "tests.stages.test_pretrain"),
    ]
