"""A new local sqlite store starts as a copy of an empty migrated one (MLflow's migrations cost
~8 s per new store): the copy must be a store MLflow itself would have made, in its own place."""

from __future__ import annotations

import sqlite3

from kiln.pipeline.tracking.runs import Tracker


def test_new_sqlite_stores_are_whole_and_their_own(tmp_path, monkeypatch):
    stores = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        monkeypatch.chdir(folder)
        tracker = Tracker(f"sqlite:///{folder / 'mlflow.db'}", "kiln-test")
        run = tracker.start("r", {"kiln.stage": "x"})
        tracker.log(run, metrics={"m": 1.0})
        tracker.end(run)
        experiments = {e.name: e for e in tracker.client.search_experiments()}
        assert set(experiments) == {"Default", "kiln-test"}
        for e in experiments.values():  # artifacts land beside this store, not the template's maker
            assert e.artifact_location.startswith(str(folder)), e.artifact_location
        assert tracker.client.get_run(run).data.metrics == {"m": 1.0}
        stores.append(folder / "mlflow.db")
    versions = [sqlite3.connect(db).execute("select version_num from alembic_version").fetchall() for db in stores]
    assert versions[0] == versions[1] and len(versions[0]) == 1
