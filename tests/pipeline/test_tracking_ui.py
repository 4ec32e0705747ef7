"""What the MLflow UI reads from a kiln store, written without a browser: the experiment's kind
(on one an older kiln made too) and the view its links open, the verdict in the run's name and
metric (or that there was none), the deciding figures as metrics, the evaluation data as the run's
inputs. tests/pipeline/test_ui_browser.py looks at the same through the UI."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from kiln.core.gate.base import Evidence
from kiln.core.gate.policy import GateSection, judge
from kiln.core.stats import Comparison
from kiln.pipeline.report.report import Sections, run_figures
from kiln.pipeline.tracking.runs import PASSED, VIEW_TAG, Tracker, experiment_url, view_figures


def test_experiment_kind_verdict_and_inputs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient

    MlflowClient(uri, uri).create_experiment("made-before")  # as an older kiln left it: no kind
    for name in ("kiln-test", "made-before"):
        tracker = Tracker(uri, name)
        assert tracker.client.get_experiment(tracker.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert experiment_url("http://u:p@host:5000/", tracker.experiment_id) == \
        f"http://***@host:5000/#/experiments/{tracker.experiment_id}/runs?workflowType=machine_learning" \
        "&viewStateShareKey=kiln"
    # the view that link opens: pipeline runs alone, the verdict and the speed-up as the first columns
    shared = json.loads(tracker.client.get_experiment(tracker.experiment_id).tags[VIEW_TAG])
    assert shared["searchFilter"] == "tags.`kiln.kind` = 'pipeline'"
    assert shared["selectedColumns"][:2] == ["metrics.`kiln.passed`", "metrics.`speedup`"]
    assert shared["columnOrder"] == shared["selectedColumns"]

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


def test_a_run_without_a_verdict_says_so_and_never_reads_as_failed(tmp_path):
    """Ctrl-C (KILLED), an error (FAILED), or a process found dead by the next run (mark_stale):
    the pipeline run's name and kiln.verdict say it ended without a verdict; its stages keep theirs."""
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "kiln-test")
    pipeline = {"kiln.kind": "pipeline", "kiln.recipe": "r", "kiln.run_dir": str(tmp_path / "runs" / "r-1")}
    interrupted, crashed = tracker.start("r-1", pipeline), tracker.start("r-1", pipeline)
    stage = tracker.start("quality[candidate]", {"kiln.stage": "quality", "kiln.recipe": "r"}, parent=interrupted)
    tracker.end(stage, "KILLED")
    tracker.end(interrupted, "KILLED")
    tracker.end(crashed, "FAILED")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone: the process that owned the run was killed
    stale = tracker.start("r-1", pipeline)
    tracker.log(stale, tags={"kiln.pid": str(dead.pid)})
    assert tracker.mark_stale({"kiln.recipe": "r"}) == [stale]
    runs = {run: tracker.client.get_run(run) for run in (interrupted, crashed, stage, stale)}
    for run, name, verdict in ((interrupted, "⏹ Interrupted · r-1", "Interrupted"),
                               (stale, "⏹ Interrupted · r-1", "Interrupted"), (crashed, "⛔ Not judged · r-1", "Not judged")):
        assert runs[run].info.run_name == name and runs[run].data.tags["kiln.verdict"] == verdict
        assert "Failed" not in name and PASSED not in runs[run].data.metrics  # no verdict: nothing to sort as one
    assert runs[stage].info.run_name == "quality[candidate]" and "kiln.verdict" not in runs[stage].data.tags
    assert [runs[r].info.status for r in (interrupted, crashed, stale)] == ["KILLED", "FAILED", "KILLED"]


def _evidence() -> tuple[Evidence, Evidence]:
    """Three interleaved decode pairs (the candidate ~1.5x faster), the first token slower, the
    artifact half the size, and a load sweep's cost per 1M output tokens."""
    base, cand = Evidence("baseline"), Evidence("candidate")
    for ev, tok_s, ttft, size, cost in ((base, [10, 10.2, 9.9], [50, 51, 49], 4e8, 0.8),
                                        (cand, [15, 15.1, 14.8], [60, 60, 61], 2e8, 0.5)):
        ev.repeats.update(decode_tok_s=tok_s, ttft_ms=ttft)
        ev.metrics.update(decode_tok_s=float(np.median(tok_s)), ttft_ms=float(np.median(ttft)), size_bytes=size,
                          load_cost_per_1m_output_tokens=cost)
    return cand, base


def test_parent_run_carries_the_deciding_figures_as_metrics_and_columns(tmp_path):
    """The figures the report decides on, named once (kiln.core.metrics), on the parent run; a
    recipe's own quality metric joins the view's columns, its interval ends do not."""
    unguarded = {"max_cpu_pressure": None, "max_cpu_steal": None}
    policy = GateSection.model_validate({"checks": [
        {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 1.2, **unguarded},
        {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.5, **unguarded},
        {"kind": "performance", "metric": "decode_tok_s", "min": 5, "name": "absolute", **unguarded},
        {"kind": "size", "max_ratio": 1.0}]})
    cand, base = _evidence()
    results = judge(policy, cand, base).results
    ppl = Comparison("perplexity", 10.0, 10.1, 0.01, -0.002, 0.022, 0.2, 40, "paired", 0.95, relative=True)
    acc = Comparison("word_swap_acc", 0.6, 0.58, -0.02, -0.08, 0.04, 0.5, 40, "McNemar", 0.95)
    record = {"winner": "q4", "baseline": {"cost_per_1m": 2.0},
              "candidates": [{"name": "q8", "cost_per_1m": 1.5}, {"name": "q4", "cost_per_1m": 1.0}]}
    figures = run_figures(results, {c.label: c for c in policy.checks},
                          Sections(comparisons=[ppl, acc], search=record), {"candidate": cand, "baseline": base})
    speed = results[0]
    assert figures["speedup"] == speed.observed and (figures["speedup_lo"], figures["speedup_hi"]) == speed.ci
    assert 1.4 < figures["speedup"] < 1.6 and figures["ratio.ttft_ms"] > 1.1 and "ratio.ttft_ms_lo" in figures
    assert figures["ratio.size_bytes"] == 0.5 and "ratio.size_bytes_lo" not in figures  # exact: no interval
    assert (figures["quality.perplexity.delta"], figures["quality.perplexity.delta_lo"]) == (0.01, -0.002)
    assert figures["quality.word_swap_acc.delta_hi"] == 0.04
    assert (figures["cost_per_1m.candidate"], figures["cost_per_1m.baseline"]) == (0.5, 0.8)
    assert (figures["cost_per_1m_b1.candidate"], figures["cost_per_1m_b1.baseline"]) == (1.0, 2.0)  # the winner's
    assert not [f for f in figures if "decode_tok_s" in f or "absolute" in f]  # an absolute bound is no ratio

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "kiln-test")
    run = tracker.start("r-1", {"kiln.kind": "pipeline"})
    tracker.show_figures(run, figures)
    assert tracker.client.get_run(run).data.metrics == figures
    shown = view_figures(tracker.client.get_experiment(tracker.experiment_id).tags[VIEW_TAG])
    assert shown[:3] == ["kiln.passed", "speedup", "speedup_lo"]
    assert "quality.word_swap_acc.delta" in shown and "ratio.ttft_ms" in shown
    assert not [f for f in shown if f.endswith(("_lo", "_hi")) and not f.startswith("speedup")]
