"""`kiln run` end to end on a tiny model: run dir, MLflow tree, registry, caching and resume."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from tests.pipeline.conftest import kiln, write_recipe


def _client(work: Path) -> MlflowClient:
    uri = f"sqlite:///{work / 'mlflow.db'}"
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def test_run_writes_report_verdict_and_stage_manifests(tiny_run):
    run_dir = tiny_run["run_dir"]
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] in {"Successful", "Failed", "Inconclusive"}
    assert verdict["exit_code"] == tiny_run["proc"].returncode
    assert len(verdict["checks"]) == 4
    swap = next(c for c in verdict["checks"] if c["metric"] == "word_swap_acc")
    assert "mcnemar" in swap["method"].lower() and swap["verdict"] != "Error", swap
    report = (run_dir / "report.md").read_text()
    assert report.startswith("# kiln: tiny — ") and verdict["verdict"] in report.splitlines()[0]
    stages = {p.stem for p in (run_dir / "stages").glob("*.json")}
    assert {"optimize-baseline", "optimize-candidate", "engine-baseline", "engine-candidate", "quality-baseline",
            "quality-candidate", "agreement-candidate", "lmeval-baseline", "lmeval-candidate",
            "benchmark-pair"} <= stages
    bench = json.loads((Path(json.loads((run_dir / "stages" / "benchmark-pair.json").read_text())["path"])
                        / "result.json").read_text())
    assert 0 <= bench["machine"]["cpu_pressure"] <= 1  # how busy the machine was while measuring
    # ... by the signal named (PSI here; the run queue where the kernel has none), and the hypervisor's steal
    pressure = {"PSI": "bench_cpu_pressure", "run queue": "bench_run_queue_pressure"}[bench["machine"]["signal"]]
    assert bench["per_role"]["candidate"]["metrics"][pressure] == bench["machine"]["cpu_pressure"]
    assert bench["per_role"]["candidate"]["metrics"]["bench_cpu_steal"] == bench["machine"]["cpu_steal"]
    for p in (run_dir / "stages").glob("*.json"):
        stage = json.loads(p.read_text())
        manifest = json.loads((Path(stage["path"]) / "manifest.json").read_text())
        assert manifest["environment"]["libraries"]["torch"].startswith("2.13")
        assert manifest["inputs"] and manifest["wall_s"] >= 0


def test_mlflow_holds_parent_children_and_registry(tiny_run):
    client = _client(tiny_run["work"])
    exp = client.get_experiment_by_name("kiln-test")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("kiln.kind") == "pipeline"]
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["kiln.verdict"]
    assert parent.data.params["optimize.method"] == "int8_weight_only"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = {(r.data.tags["kiln.stage"], r.data.tags["kiln.role"]) for r in children}
    assert ("quality", "candidate") in names and ("gate", "candidate") in names
    quality = next(r for r in children if r.data.tags["kiln.stage"] == "quality" and r.data.tags["kiln.role"] == "baseline")
    assert quality.data.metrics["perplexity"] > 1
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.html", "verdict.json", "recipe.yaml"} <= artifacts
    registered = json.loads((tiny_run["run_dir"] / "registry.json").read_text())
    mv = client.get_model_version("tiny", str(registered["version"]))
    assert mv.tags["kiln.verdict"] == parent.data.tags["kiln.verdict"]
    passed = tiny_run["proc"].returncode == 0
    assert mv.tags["kiln.passed"] == str(passed).lower() and registered["alias"] == ("challenger" if passed else None)
    assert ("challenger" in mv.aliases) is passed  # the alias goes only to a version whose run passed
    assert mv.run_id == parent.info.run_id


def test_rerun_reuses_every_stage(tiny_run):
    proc = kiln("run", str(tiny_run["recipe"]), cwd=tiny_run["work"])
    assert proc.returncode == tiny_run["proc"].returncode, proc.stderr[-2000:]
    newest = max((tiny_run["work"] / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    assert newest != tiny_run["run_dir"]
    reused = [json.loads(p.read_text())["reused"] for p in (newest / "stages").glob("*.json")]
    assert reused and all(reused)
    assert json.loads((newest / "verdict.json").read_text()) == json.loads((tiny_run["run_dir"] / "verdict.json").read_text())


def test_sigkill_then_ctrl_c_mid_evaluate_resume_the_same_run(tmp_path, tiny_model_dir, demo_data):
    # A quality stage with many documents so there is time to stop it half-way; the text starts
    # with this test's own path, so the stage is never already in the cache.
    text = tmp_path / "heldout.txt"
    text.write_text(f"{tmp_path}\n" + Path(demo_data.eval_text).read_text())
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, name="killme",
                          evaluate__quality={"perplexity": {"text": str(text), "max_documents": 64, "seq_len": 128},
                                             "agreement": False},
                          gate={"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}]})
    cache = Path(os.environ["KILN_CACHE"])
    before = set((cache / "stages" / "quality").glob("*")) if (cache / "stages" / "quality").exists() else set()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "run", str(recipe)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    partial = None
    while time.time() < deadline and proc.poll() is None and partial is None:
        partial = next((p for p in (cache / "stages" / "quality").glob("*.partial") if p not in before), None) \
            if (cache / "stages" / "quality").exists() else None
        time.sleep(0.01)
    assert partial is not None, "the quality stage never started"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    final = partial.with_name(partial.name.removesuffix(".partial"))
    assert not (final / "result.json").exists()
    [run_dir] = (tmp_path / "runs").iterdir()

    # Ctrl-C (SIGINT to the process group, as a terminal sends it) once the stage shows its progress: a
    # line every 0.2 s here, as a CI log gets one every 10 s.
    interrupted = _interrupt_once_progress_shows(recipe, tmp_path)
    assert interrupted.returncode == 130, interrupted.stderr[-3000:]
    assert f"run the same command again: kiln run {recipe}" in interrupted.stderr
    assert "continuing the interrupted run" in interrupted.stdout and "is kept" in interrupted.stdout
    assert list((tmp_path / "runs").iterdir()) == [run_dir]  # the killed run's folder, continued
    assert json.loads((run_dir / "state.json").read_text())["status"] == "killed"
    client = _client(tmp_path)
    exp = client.get_experiment_by_name("kiln-test")
    [parent] = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'pipeline'")
    assert parent.info.status == "KILLED"  # until a run continues it

    resumed = kiln("run", str(recipe), cwd=tmp_path, env={"KILN_PROGRESS_EVERY_S": "0.2"})
    assert resumed.returncode in (0, 1, 3), resumed.stderr[-3000:]
    assert (final / "result.json").exists() and not partial.exists()
    assert list((tmp_path / "runs").iterdir()) == [run_dir]
    stages = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stages").glob("*.json")}
    assert stages["optimize-candidate"]["reused"] and stages["engine-candidate"]["reused"]
    assert not stages["quality-baseline"]["reused"] or not stages["quality-candidate"]["reused"]
    assert (run_dir / "verdict.json").exists()
    [parent] = client.search_runs([exp.experiment_id], "tags.`kiln.kind` = 'pipeline'")
    assert parent.info.status == "FINISHED"
    # the attempts' stages that were stopped stay under the parent as KILLED, beside the ones that finished
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {r.info.status for r in children} == {"FINISHED", "KILLED"}
    assert "progress quality[" in (run_dir / "kiln.log").read_text()
    listed = kiln("runs", cwd=tmp_path, check=True).stdout
    assert "done" in listed and "interrupted" not in listed
    again = kiln("run", str(recipe), "--new-run", cwd=tmp_path)  # a finished run is a record: never continued
    assert again.returncode == resumed.returncode and len(list((tmp_path / "runs").iterdir())) == 2


def _interrupt_once_progress_shows(recipe: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KILN_PROGRESS_EVERY_S": "0.2"}
    # SIGINT as a terminal's shell leaves it: a disposition of "ignored" is inherited across exec, and
    # Python then installs no KeyboardInterrupt handler (a test worker may ignore SIGINT; on CI the run
    # went on to exit 0 after the signal was sent).
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "run", str(recipe)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out, sent = [], False
    for line in proc.stdout:
        out.append(line)
        # Any progress line of the quality stage: its first may have no rate or ETA yet (on CI none with
        # both came before the stage ended, no SIGINT was sent, and the run exited 0).
        if line.startswith("  quality["):
            os.killpg(proc.pid, signal.SIGINT)
            sent = True
            break
    rest, err = proc.communicate(timeout=300)
    assert sent, "the quality stage showed no progress line: " + "".join(out)[-2000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out) + rest, err)


def test_kiln_run_under_github_actions_writes_summary_outputs_and_comment(tiny_run, tmp_path):
    """The real CLI in a simulated Actions job, for the passing policy and a failing one."""
    from tests.ci.test_github import parse_outputs

    event = tmp_path / "event.json"
    event.write_text(json.dumps({"pull_request": {"number": 7, "head": {"sha": "ab" * 20}}}))
    # The failing policy registers under a name of its own: `tiny` pins the policy it was first judged under.
    failing = ["--set", "gate.checks.2.max_ratio=0.01", "--set", "tracking.registered_model=tiny-strict"]
    for label, extra, expected in (("pass", [], None), ("fail", failing, 1)):
        summary, outputs = tmp_path / f"{label}-summary.md", tmp_path / f"{label}-outputs.txt"
        env = {"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(outputs),
               "GITHUB_EVENT_PATH": str(event), "GITHUB_EVENT_NAME": "pull_request"}
        proc = kiln("run", str(tiny_run["recipe"]), *extra, cwd=tiny_run["work"], env=env)
        code = tiny_run["proc"].returncode if expected is None else expected
        assert proc.returncode == code, proc.stderr[-2000:]
        out = parse_outputs(outputs.read_text())
        assert out["exit-code"] == str(code)
        verdict = json.loads((Path(out["run-dir"]) / "verdict.json").read_text())["verdict"]
        assert out["verdict"] == verdict and verdict in summary.read_text()
        comment = (Path(out["run-dir"]) / "pr-comment.md").read_text()
        assert comment.startswith("<!-- kiln-report:") and verdict in comment
        # Figures in their units, in the comment and on the console: no 5.416e+08, no raw byte count in a cell
        assert "e+0" not in comment + proc.stdout and not re.search(r"\| [\d.]{7,} \|", comment), comment
