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
