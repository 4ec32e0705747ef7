"""Which run folder `kiln run` continues: the newest of its recipe, only if it was interrupted (Ctrl-C,
or killed: running under a pid that is gone), started by `kiln run`, on the same tracking store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest

from kiln.pipeline.runner import interrupted_run

TRACKER = NS(experiment_id="1", uri="sqlite:////tmp/store/mlflow.db")
RECIPE = NS(digest=lambda: "d1")


def _gone_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _folder(root, name: str, started: float, **state) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "state.json").write_text(json.dumps({
        "recipe_hash": "d1", "resumable": True, "experiment_id": "1", "tracking_uri": TRACKER.uri,
        "started_at": started, "status": "killed", **state}))


def test_the_newest_interrupted_run_of_the_recipe_is_continued(tmp_path):
    _folder(tmp_path, "old", 1.0)
    _folder(tmp_path, "other-recipe", 3.0, recipe_hash="d2")
    _folder(tmp_path, "new", 2.0, status="running", pid=_gone_pid())
    assert interrupted_run(tmp_path, RECIPE, TRACKER) == tmp_path / "new"


@pytest.mark.parametrize("state", [
    {"status": "running", "pid": os.getpid()},  # still alive: another `kiln run` at work
    {"status": "done"},  # a verdict is a record
    {"status": "failed"},  # so is an error
    {"resumable": False},  # `kiln tune`'s folder
    {"experiment_id": "2"},  # its MLflow run is in another experiment
    {"tracking_uri": "sqlite:////elsewhere/mlflow.db"},  # ... or store
])
def test_anything_else_gets_a_new_folder(tmp_path, state):
    _folder(tmp_path, "older-killed", 1.0)  # only the newest counts: an older interruption is history
    _folder(tmp_path, "newest", 2.0, **state)
    assert interrupted_run(tmp_path, RECIPE, TRACKER) is None
