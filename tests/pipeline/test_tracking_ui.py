"""What the MLflow UI reads from a kiln store, written without a browser: the experiment's kind
(on one an older kiln made too), the verdict in the run's name and metric, the evaluation data as
the run's inputs. tests/pipeline/test_ui_browser.py looks at the same through the UI."""

from __future__ import annotations

from kiln.pipeline.tracking import PASSED, Tracker, experiment_url


def test_experiment_kind_verdict_and_inputs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient

    MlflowClient(uri, uri).create_experiment("made-before")  # as an older kiln left it: no kind
    for name in ("kiln-test", "made-before"):
        tracker = Tracker(uri, name)
        assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment_url("http://u:p@host:5000/", tracker.experiment_id) == \
        f"http://***@host:5000/#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    digests = []
    for verdict, passed, rows in (("Successful", True, ["a", "b"]), ("Failed", False, ["a", "c"])):
        run = tracker.start("run-dir-name", {})
        tracker.show_verdict(run, f"{verdict} · run-dir-name", verdict, passed)
        tracker.log_data(run, "benchmark", prompts, "prompt", rows)
        got = tracker.client.get_run(run)
        assert got.info.run_name == f"{verdict} · run-dir-name"
        assert got.data.metrics[PASSED] == float(passed) and got.data.tags["kiln.verdict"] == verdict
        [data] = got.inputs.dataset_inputs
        assert data.dataset.name == "prompts.jsonl" and str(prompts) in data.dataset.source
        assert {t.key: t.value for t in data.tags}["mlflow.data.context"] == "benchmark"
        digests.append(data.dataset.digest)
    assert digests[0] != digests[1]  # the digest follows the rows the run used


def test_two_runs_storing_the_same_data_at_once_both_list_it(tmp_path, monkeypatch):
    """Two runs at once (two CI jobs on one store) insert the same dataset row; MLflow refuses the
    second insert (UNIQUE experiment, name, digest), as test_concurrent_runs met: the loser is
    replayed here deterministically, the other run's insert landing between its check and its own."""
    from mlflow.exceptions import MlflowException

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "kiln-test")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    first, second = tracker.start("a", {}), tracker.start("b", {})
    real = tracker.client.log_inputs
    raced = []

    def racing(run_id, datasets):
        if not raced:
            raced.append(run_id)
            real(first, datasets)  # the other run wins the insert ...
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                  "datasets.name, datasets.digest")  # ... and this one's fails, as MLflow's does
        return real(run_id, datasets)

    monkeypatch.setattr(tracker.client, "log_inputs", racing)
    tracker.log_data(second, "benchmark", prompts, "prompt", ["a"])
    for run in (first, second):
        assert [d.dataset.name for d in tracker.client.get_run(run).inputs.dataset_inputs] == ["prompts.jsonl"]
