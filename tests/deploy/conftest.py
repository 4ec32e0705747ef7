"""Fixtures for the deploy tests: fake engines behind the router, a throwaway MLflow registry, and
the Kubernetes schema checker (npm packages installed once into the gitignored .cache/)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parents[1]


@pytest.fixture
def mlflow_registry(tmp_path):
    """A sqlite MLflow store with model 'smol': version 1 is champion, version 2 the challenger."""
    from kiln.pipeline.tracking.runs import Tracker

    from tests.pipeline.attested import attested_version

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "kiln-test")
    client = tracker.client
    client.create_registered_model("smol")
    versions = client.create_experiment("versions", artifact_location=(tmp_path / "artifacts").as_uri())
    for _ in range(2):  # as kiln registers them: from runs that passed and signed it (only those may become champion)
        attested_version(client, versions, "smol", "Successful", 0)
    client.set_registered_model_alias("smol", "champion", "1")
    client.set_registered_model_alias("smol", "challenger", "2")
    return tracker


@pytest.fixture(scope="session")
def k8s_validator():
    """validate(docs) -> report from tests/deploy/k8s_schema/validate.mjs (ajv schemas + tsc)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "the manifest schema check needs Node.js and npm (Debian: apt-get install nodejs npm)"
    work = REPO / ".cache" / "k8s-schema"
    work.mkdir(parents=True, exist_ok=True)
    for name in ("package.json", "package-lock.json", "validate.mjs"):
        shutil.copy2(HERE / "k8s_schema" / name, work / name)
    stamp = work / "node_modules" / ".kiln-lock"
    lock = (work / "package-lock.json").read_text()
    if not stamp.exists() or stamp.read_text() != lock:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=work, check=True, capture_output=True, timeout=600)
        stamp.write_text(lock)

    def validate(docs: list[dict]) -> dict:
        out = subprocess.run([node, str(work / "validate.mjs")], input=json.dumps(docs), cwd=work,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    return validate
