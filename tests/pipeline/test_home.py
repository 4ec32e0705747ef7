"""One home (issue 54, point 5): runs, the default tracking store and its artifacts live in kiln's
home ($KILN_HOME, else ~/.local/share/kiln), not in the folder a command is started from; `kiln
runs` finds them from anywhere and says where it looked when it finds none; `kiln cache list` reads
what is needed from the stores the runs used and files each stage under the models that ran it.

A real `kiln run` started in one folder and found from another: tests/pipeline/test_cache_location.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kiln.core import home
from tests.pipeline.conftest import kiln
from tests.pipeline.test_cache_cmd import Cache


def test_the_home_is_kiln_home_else_xdg_data_else_local_share(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("KILN_HOME")
    assert home.kiln_home() == tmp_path / "user" / ".local" / "share" / "kiln"
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert home.runs_root() == tmp_path / "data" / "kiln" / "runs"
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "mine"))
    assert home.default_tracking_uri() == f"sqlite:///{tmp_path / 'mine' / 'mlflow.db'}"
    assert home.runs_root(Path("elsewhere")) == Path("elsewhere")  # --runs wins
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert home.default_tracking_uri() == "http://127.0.0.1:5000"


def test_a_sqlite_store_keeps_its_artifacts_beside_it_not_in_the_current_folder(tmp_path, monkeypatch):
    from kiln.pipeline.tracking.runs import Tracker

    cwd, kiln_home = tmp_path / "where-the-user-stands", tmp_path / "home"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("KILN_HOME", str(kiln_home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "report.md").write_text("# a report\n")
    for uri, store in ((None, kiln_home), (f"sqlite:///{tmp_path / 'team' / 'mlflow.db'}", tmp_path / "team")):
        tracker = Tracker(uri, "my exp")
        run = tracker.start("r", {})
        tracker.log_artifacts(run, tmp_path / "report.md")
        assert (store / "mlflow.db").is_file()
        assert (store / "mlruns" / "my_exp" / run / "artifacts" / "report.md").is_file()
    assert list(cwd.iterdir()) == []


def _fake_run(runs: Path, name: str) -> Path:
    d = runs / name
    (d / "stages").mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"status": "done", "verdict": "Successful", "exit_code": 0}))
    return d


def test_runs_lists_the_home_from_any_folder_and_says_where_it_looked_when_empty(tmp_path):
    kiln_home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    empty = kiln("runs", cwd=elsewhere, env={"KILN_HOME": str(kiln_home)})
    assert empty.returncode == 0, empty.stderr
    said = " ".join(empty.stderr.split())
    assert f"no runs under {kiln_home / 'runs'}" in said and "--runs FOLDER" in said and "$KILN_HOME" in said
    _fake_run(kiln_home / "runs", "my-run")
    listed = kiln("runs", "--json", cwd=elsewhere, env={"KILN_HOME": str(kiln_home)})
    assert [r["run"] for r in json.loads(listed.stdout)] == ["my-run"] and listed.stderr == ""
    shown = kiln("show", "my-run", "--json", cwd=elsewhere, env={"KILN_HOME": str(kiln_home)})
    assert json.loads(shown.stdout)["run_dir"] == str(kiln_home / "runs" / "my-run"), shown.stderr


def _run(runs: Path, name: str, model: Path, uri: str, *stages: Path) -> Path:
    """A run folder as `kiln run` leaves it, as far as `kiln cache` reads it: its stage records, the
    model in its recipe, the tracking store in its state."""
    d = _fake_run(runs, name)
    for s in stages:
        (d / "stages" / f"{s.parent.name}-{s.name}.json").write_text(json.dumps({"stage": s.parent.name, "path": str(s)}))
    (d / "recipe.yaml").write_text(yaml.safe_dump({"name": name, "model": {"path": str(model)}}))
    (d / "state.json").write_text(json.dumps({"status": "done", "tracking_uri": uri}))
    return d


def test_cache_list_reads_needs_from_each_run_s_store_and_files_stages_by_the_runs_models(tmp_path, monkeypatch):
    """The user's fine-tune is a copy of the demo checkpoint, so both share the q8_0 artifact (keyed
    by content), which the user's run computed first: its manifest names the user's folder, and every
    demo stage built on it was filed under the user's model. The demo's run is registered in a store
    of its own (state.json), not in one where `kiln cache list` is started."""
    from kiln.pipeline.tracking.runs import open_client

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kiln_home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    c = Cache(tmp_path / "cache")
    demo, mine = tmp_path / "models" / "smollm2", tmp_path / "models" / "my-fine-tune"
    c.model = mine  # the user's run computed the shared artifact
    q8 = c.optimize("q8", 1, 1)
    user_engine, demo_engine = c.engine("e-user", q8, 1), c.engine("e-demo", q8, 1)
    user_chain = [c.stage("engine", "s-user", 1, user_engine), c.stage("quality", "p-user", 1, user_engine)]
    demo_chain = [c.stage("engine", "s-demo", 1, demo_engine), c.stage("quality", "p-demo", 1, demo_engine)]
    store = f"sqlite:///{tmp_path / 'demo-store' / 'mlflow.db'}"
    runs = kiln_home / "runs"
    demo_run = _run(runs, "demo-1", demo, store, q8, *demo_chain)
    _run(runs, "mine-1", mine, f"sqlite:///{tmp_path / 'my-store' / 'mlflow.db'}", q8, *user_chain)
    _run(runs, "remote-1", mine, "http://***@127.0.0.1:9/", user_chain[1])  # a store whose password was not kept
    client = open_client(store)
    client.create_registered_model("demo")
    client.create_model_version("demo", source=str(q8 / "model"), tags={"kiln.run_dir": str(demo_run)})

    r = kiln("cache", "list", "--json", cwd=elsewhere, env={"KILN_HOME": str(kiln_home), "KILN_CACHE": str(c.root)})
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    by_key = {e["key"]: e for e in listed["entries"]}
    assert {k: e["model"] for k, e in by_key.items()} == {
        "q8": "my-fine-tune, smollm2", "e-user": "my-fine-tune", "s-user": "my-fine-tune", "p-user": "my-fine-tune",
        "e-demo": "smollm2", "s-demo": "smollm2", "p-demo": "smollm2"}
    assert {k: e["needed"] for k, e in by_key.items() if e["needed"]} == {
        "q8": "registered version's run demo-1", "s-demo": "registered version's run demo-1",
        "p-demo": "registered version's run demo-1", "e-demo": "needed by engine s-demo",
        "p-user": "run remote-1: its tracking store could not be read"}
    said = " ".join(listed["needs_from"].split())
    assert f"1 registered versions in {store}" in said and "http://***@127.0.0.1:9/" in said
    assert "credentials were not kept" in said and "$MLFLOW_TRACKING_URI" in said
    assert list(elsewhere.iterdir()) == []  # and no store was made where the command ran
