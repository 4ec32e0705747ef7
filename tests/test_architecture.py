"""The floor plan holds: layers import only downward, no circles, short functions, a current map.

The contracts live in pyproject.toml ([tool.importlinter]). Plain `lint-imports` runs them in the
checkout (their roots are the six mapped folders); ci/architecture.py runs them on a tree of links,
which also checks a copy of the folders.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("kiln_architecture", ROOT / "ci" / "architecture.py")
architecture = importlib.util.module_from_spec(spec)
sys.modules["kiln_architecture"] = architecture
spec.loader.exec_module(architecture)

MAX_FUNCTION_LINES = 50


def test_every_layer_imports_only_the_layers_below_it_and_no_package_has_a_circle():
    result = architecture.lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_plain_lint_imports_in_the_checkout_keeps_the_contracts_on_every_module():
    """What a contributor types: `lint-imports` in the checkout, no links, the same modules as the tree."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    plain = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "Contracts: 2 kept, 0 broken." in plain.stdout
    analyzed = re.compile(r"Analyzed (\d+) files")
    assert analyzed.search(plain.stdout)[1] == analyzed.search(architecture.lint().stdout)[1]


def test_the_contract_covers_every_code_folder_and_sees_every_module():
    assert sorted(f"kiln.{name}" for name in architecture.folders()) == sorted(architecture.layers())
    assert sorted(architecture.pyproject()["tool"]["importlinter"]["root_packages"]) == sorted(architecture.layers())
    files = {".".join(["kiln", name, *p.relative_to(folder).with_suffix("").parts]).removesuffix(".__init__")
             for name, folder in architecture.folders().items() for p in folder.rglob("*.py")}
    assert files <= architecture.import_graph().modules


def test_the_contract_catches_an_upward_import(tmp_path):
    """A copy of the checkout with one upward import (the ground floor reaching the orchestrator)."""
    for name, folder in architecture.folders().items():
        (tmp_path / folder.relative_to(ROOT)).symlink_to(folder, target_is_directory=True)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    core = tmp_path / "core"
    core.unlink()
    core.mkdir()
    for p in (ROOT / "core").iterdir():
        if p.name != "__pycache__":
            (core / p.name).symlink_to(p, target_is_directory=p.is_dir())
    (core / "upward.py").write_text("def f():\n    from kiln.pipeline import runner\n    return runner\n")
    result = architecture.lint(tmp_path)
    assert result.returncode != 0
    assert "kiln.core.upward -> kiln.pipeline.runner" in result.stdout


def _functions(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path.relative_to(ROOT), node.name, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("folder", sorted(architecture.folders().values(), key=str) + [ROOT / "ci"],
                         ids=lambda f: f.name)
def test_no_function_is_over_fifty_lines(folder):
    long = [f"{path}:{name} ({lines} lines)" for path, name, lines in _functions(folder) if lines > MAX_FUNCTION_LINES]
    assert not long, "split these into named steps: " + ", ".join(long)


def test_the_picture_in_docs_architecture_is_drawn_from_todays_imports():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert architecture.rewrite(doc, architecture.mermaid()) == doc, \
        "docs/architecture.md is stale: run `python ci/architecture.py graph --write`"
