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
KEPT = f"Contracts: {len(architecture.pyproject()['tool']['importlinter']['contracts'])} kept, 0 broken."


def test_every_layer_imports_only_the_layers_below_it_and_no_package_has_a_circle():
    result = architecture.lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert KEPT in result.stdout


def test_plain_lint_imports_in_the_checkout_keeps_the_contracts_on_every_module():
    """What a contributor types: `lint-imports` in the checkout, no links, the same modules as the tree."""
    lint_imports = Path(sys.executable).with_name("lint-imports")
    plain = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert KEPT in plain.stdout
    analyzed = re.compile(r"Analyzed (\d+) files")
    assert analyzed.search(plain.stdout)[1] == analyzed.search(architecture.lint().stdout)[1]


def test_the_contract_covers_every_code_folder_and_sees_every_module():
    assert sorted(f"kiln.{name}" for name in architecture.folders()) == sorted(architecture.layers())
    assert sorted(architecture.pyproject()["tool"]["importlinter"]["root_packages"]) == sorted(architecture.layers())
    files = {".".join(["kiln", name, *p.relative_to(folder).with_suffix("").parts]).removesuffix(".__init__")
             for name, folder in architecture.folders().items() for p in folder.rglob("*.py")}
    assert files <= architecture.import_graph().modules


def _copy_with(tmp_path: Path, folder: str, name: str, source: str) -> Path:
    """A linked copy of the checkout with one module added to `folder` (a relative path, linked file by file)."""
    for top, mapped in architecture.folders().items():
        (tmp_path / mapped.relative_to(ROOT)).symlink_to(mapped, target_is_directory=True)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    parts = Path(folder).parts
    for depth in range(1, len(parts) + 1):  # unlink the path down to `folder`, linking its siblings
        here = tmp_path.joinpath(*parts[:depth])
        here.unlink()
        here.mkdir()
        for p in ROOT.joinpath(*parts[:depth]).iterdir():
            if p.name != "__pycache__" and not (depth < len(parts) and p.name == parts[depth]):
                (here / p.name).symlink_to(p, target_is_directory=p.is_dir())
        if depth < len(parts):
            here.joinpath(parts[depth]).symlink_to(ROOT.joinpath(*parts[:depth + 1]), target_is_directory=True)
    (tmp_path / folder / name).write_text(source)
    return tmp_path


@pytest.mark.parametrize(("folder", "module", "imports"), [
    ("core", "kiln.core.upward", "kiln.pipeline.runner"),  # the ground floor reaching the orchestrator
    ("pipeline/stages", "kiln.pipeline.stages.upward", "kiln.pipeline.search.search"),  # a stage reaching the search
    ("engine/llama_cpp", "kiln.engine.llama_cpp.upward", "kiln.engine.serve.server"),  # a backend reaching the server
])
def test_the_contract_catches_an_arrow_back_up(tmp_path, folder, module, imports):
    """A copy of the checkout with one upward import, between the floors or inside pipeline/ or engine/."""
    package, _, name = imports.rpartition(".")
    copy = _copy_with(tmp_path, folder, "upward.py", f"def f():\n    from {package} import {name}\n    return {name}\n")
    result = architecture.lint(copy)
    assert result.returncode != 0
    assert f"{module} -> {imports}" in result.stdout


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
