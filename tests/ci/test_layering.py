"""The arrows between kiln's packages point one way: a quantizer knows no engine, engines are
measured from outside (engine/ never imports evaluate/ or deploy/), serving knows no rollout."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "engine": ("kiln.evaluate", "kiln.deploy"),
    "optimize": ("kiln.engine", "kiln.evaluate", "kiln.deploy", "kiln.pipeline.demo"),  # the pipeline resolves data
    "evaluate": ("kiln.deploy",),
}
KNOWN: set[str] = set()  # exceptions, each with its reason; none now (tuning moved to evaluate/tune.py)


def kiln_imports(path: Path) -> set[str]:
    """Every kiln module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kiln.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln."):
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_the_wrong_way(package):
    wrong = {f"{path.relative_to(ROOT)}: {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for module in kiln_imports(path) if module.startswith(FORBIDDEN[package])}
    assert not wrong - KNOWN, sorted(wrong - KNOWN)


def test_known_exceptions_still_exist():
    """An exception that is gone must leave KNOWN too, so the list never hides a new one."""
    still = {f"{path}: {module}" for path in {k.split(":")[0] for k in KNOWN} for module in kiln_imports(ROOT / path)}
    assert KNOWN <= still, sorted(KNOWN - still)


def test_the_check_sees_a_planted_import(tmp_path):
    planted = tmp_path / "x.py"
    planted.write_text("def f():\n    from kiln.deploy.config import RouterConfig\n")
    assert kiln_imports(planted) == {"kiln.deploy.config"}
