"""kiln's floor plan, drawn from its imports and checked against the layer contract.

The code folders are mapped into the one import package `kiln` (pyproject's package-dir). In the
checkout plain `lint-imports` runs the contracts: their roots are the six folders, which the
editable install maps. This script runs them on a tree of links, `kiln/<folder> -> <root>/<folder>`,
built in a temporary folder, so it can check any copy of the folders too (the editable install
maps `kiln` to this checkout only); tests/test_architecture.py checks that both see the same.

    python ci/architecture.py lint             # the import-linter contracts in pyproject.toml
    python ci/architecture.py graph --write    # redraw the picture in docs/architecture.md
    python ci/architecture.py graph --check    # exit 1 if the committed picture is stale

The picture is one node per layer and per subpackage, an arrow where one imports the other,
labelled with how many modules import how many (what grimp sees, function-level imports too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
START, END = "<!-- import-graph:start (python ci/architecture.py graph --write) -->", "<!-- import-graph:end -->"


def pyproject(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text())


def layers(root: Path = ROOT) -> list[str]:
    """The layers, top to bottom, as the layers contract in pyproject.toml states them."""
    contracts = pyproject(root)["tool"]["importlinter"]["contracts"]
    return next(c["layers"] for c in contracts if c["type"] == "layers")


def folders(root: Path = ROOT) -> dict[str, Path]:
    """kiln's top-level subpackages and the folder each is mapped from (kiln.core -> core/ ...)."""
    mapping = pyproject(root)["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: root / path for name, path in mapping.items() if name.count(".") == 1}


@contextlib.contextmanager
def linked_tree(root: Path = ROOT) -> Iterator[Path]:
    """A temporary folder holding `kiln/` with a link to each mapped folder: put it first on the path."""
    with tempfile.TemporaryDirectory(prefix="kiln-imports-") as tmp:
        package = Path(tmp) / "kiln"
        package.mkdir()
        for name, folder in folders(root).items():
            (package / name).symlink_to(folder, target_is_directory=True)
        yield Path(tmp)


def lint(root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run import-linter on the contracts in pyproject.toml; its report is in stdout."""
    with linked_tree(root) as tree:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        lint_imports = Path(sys.executable).with_name("lint-imports")
        return subprocess.run([str(lint_imports), "--config", str(root / "pyproject.toml"), "--no-cache"],
                              capture_output=True, text=True, env=env, cwd=tree, timeout=300)


def _node(module: str, subpackages: set[str]) -> str:
    """kiln.evaluate.perf.metrics -> kiln.evaluate.perf; kiln.engine.serve.server -> kiln.engine."""
    parts = module.split(".")
    return ".".join(parts[:3]) if ".".join(parts[:3]) in subpackages else ".".join(parts[:2])


def import_graph(root: Path = ROOT):
    """grimp's graph of every module under kiln, function-level imports included."""
    import grimp

    with linked_tree(root) as tree:
        sys.path.insert(0, str(tree))
        try:
            return grimp.build_graph("kiln", cache_dir=None)
        finally:
            sys.path.remove(str(tree))


def edges(root: Path = ROOT) -> tuple[list[str], Counter[tuple[str, str]]]:
    """The nodes (layers and subpackages) and, per arrow between two of them, the module imports."""
    graph = import_graph(root)
    subpackages = {m for m in graph.modules if m.count(".") == 2 and graph.find_children(m)}
    nodes = sorted({_node(m, subpackages) for m in graph.modules if m.count(".") >= 1})
    count: Counter[tuple[str, str]] = Counter()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = _node(module, subpackages), _node(imported, subpackages)
            if a != b and "." in a and "." in b:
                count[a, b] += 1
    return nodes, count


def mermaid(root: Path = ROOT) -> str:
    nodes, count = edges(root)
    order = layers(root)
    ids = {n: n.removeprefix("kiln.").replace(".", "_") for n in nodes}
    lines = ["```mermaid", "flowchart TD"]
    for layer in order:
        inside = [n for n in nodes if n == layer or n.startswith(layer + ".")]
        lines.append(f"  subgraph {ids[layer]}_layer[\"{layer.removeprefix('kiln.')}/\"]")
        lines += [f"    {ids[n]}[\"{n.removeprefix('kiln.')}\"]" for n in inside]
        lines.append("  end")
    lines += [f"  {ids[a]} -->|{k}| {ids[b]}" for (a, b), k in sorted(count.items())]
    lines.append("```")
    return "\n".join(lines)


def rewrite(doc: str, picture: str) -> str:
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{picture}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("lint", help="run the import-linter contracts")
    draw = sub.add_parser("graph", help="the import picture in docs/architecture.md")
    draw.add_argument("--write", action="store_true", help="rewrite the picture in place")
    draw.add_argument("--check", action="store_true", help="exit 1 if the committed picture is stale")
    args = parser.parse_args()
    if args.command == "lint":
        result = lint()
        print(result.stdout + result.stderr)
        return result.returncode
    if not (args.write or args.check):
        print(mermaid())
        return 0
    fresh = rewrite(DOC.read_text(), mermaid())
    if args.write:
        DOC.write_text(fresh)
    elif fresh != DOC.read_text():
        print(f"{DOC} is stale: run `python ci/architecture.py graph --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
