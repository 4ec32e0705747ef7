"""Registration survives a kill: a `kiln run` SIGKILLed while publishing leaves no version tagged as
finished and, once run again (which continues the killed run), no run RUNNING and still one version,
now complete."""

from __future__ import annotations

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from tests.pipeline.conftest import kiln, write_recipe

# `kiln run`, SIGKILLed at one point of publishing: right after the version is created, or just
# before it is completed. The real CLI otherwise; nothing else is replaced.
KILLED_RUN = """
import os, signal, sys
from kiln.pipeline.tracking import registry as model_registry
point = sys.argv.pop(1)
original = model_registry.register
def register(*args, **kwargs):
    version = original(*args, **kwargs)
    if point == "after-create":
        os.kill(os.getpid(), signal.SIGKILL)
    return version
def complete(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
model_registry.register = register
if point == "before-complete":
    model_registry.complete = complete
from kiln.pipeline.cli.main import main
main()
"""


@pytest.mark.parametrize("point", ["after-create", "before-complete"])
def test_a_run_killed_while_publishing_leaves_nothing_that_looks_finished(point, tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir)
    killed = subprocess.run([sys.executable, "-c", KILLED_RUN, point, "run", str(recipe)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    [version] = client.search_model_versions("name = 'tiny'")
    assert version.tags["kiln.registration"] == "incomplete"
    assert "kiln.verdict" not in version.tags and not version.aliases

    again = kiln("run", str(recipe), cwd=tmp_path)
    assert again.returncode in (0, 1, 3), again.stderr[-3000:]
    [version] = client.search_model_versions("name = 'tiny'")
    assert version.tags["kiln.registration"] == "complete" and version.tags["kiln.verdict"]
    assert ("challenger" in version.aliases) is (again.returncode == 0)  # only a version whose run passed
    exp = client.get_experiment_by_name("kiln-test")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert "RUNNING" not in {r.info.status for r in runs}
    parents = [r.info.status for r in runs if r.data.tags.get("kiln.kind") == "pipeline"]
    assert parents == ["FINISHED"]  # the second run continued the killed one, its folder and its MLflow run
    assert len(list((tmp_path / "runs").iterdir())) == 1
