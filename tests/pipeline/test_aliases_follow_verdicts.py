"""Aliases follow verdicts, against a real `mlflow server` on 127.0.0.1: `challenger` goes only to a
version whose run passed and leaves one whose latest run did not; `kiln promote`, `kiln rollback --to`,
`kiln deploy canary` and `kiln deploy render --model-version` refuse a version whose signed verdict did not pass
(exit 2, naming the run and its verdict) unless `--force --reason TEXT`, which is recorded with that one
action and never read as permission by a later one."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from mlflow.tracking import MlflowClient

from kiln.pipeline.tracking import registry as model_registry
from kiln.core.errors import ExitCode
from kiln.core.gate.base import Verdict
from kiln.core.gate.policy import GateOutcome
from tests.pipeline.attested import attested_version
from tests.pipeline.conftest import TINY_RECIPE, kiln
from tests.tracking_servers import mlflow_server


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A real tracking server holding model 'm': v1 from a run that passed, v2 and v3 from runs that failed."""
    work = tmp_path_factory.mktemp("aliases")
    with mlflow_server(work) as uri:
        client = MlflowClient(uri)
        exp = client.create_experiment("aliases")
        client.create_registered_model("m")
        runs = {}
        for verdict, code in (("Successful", 0), ("Failed", 1), ("Inconclusive", 3)):
            version, runs[str(len(runs) + 1)] = attested_version(client, exp, "m", verdict, code)
            assert version == str(len(runs))
        yield SimpleNamespace(uri=uri, client=client, work=work, runs=runs)


def _champion(client: MlflowClient) -> str:
    return str(client.get_model_version_by_alias("m", "champion").version)


def _kiln(registry, *args: str):
    return kiln(*args, "--tracking-uri", registry.uri, cwd=registry.work)


def test_promote_refuses_a_version_whose_run_did_not_pass_unless_forced_with_a_reason(registry):
    client = registry.client
    assert _kiln(registry, "promote", "m", "1").returncode == 0 and _champion(client) == "1"
    refused = _kiln(registry, "promote", "m", "2")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "m v2 did not pass" in refused.stderr and "Failed" in refused.stderr and registry.runs["2"] in refused.stderr
    assert "Traceback" not in refused.stderr and _champion(client) == "1"
    no_reason = _kiln(registry, "promote", "m", "2", "--force")
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr and _champion(client) == "1"
    forced = _kiln(registry, "promote", "m", "2", "--force", "--reason", "hotfix: the Failed check is a known flake")
    assert forced.returncode == 0, forced.stderr
    assert _champion(client) == "2"
    overrides = json.loads(client.get_model_version("m", "2").tags[model_registry.OVERRIDES])
    assert overrides[-1]["action"] == "promote" and overrides[-1]["reason"] == "hotfix: the Failed check is a known flake"
    last = model_registry.history(client, "m")[-1]
    assert last["version"] == "2" and last["previous"] == "1" and last["forced"].startswith("hotfix")
    # rollback reads the history: back to v1
    back = _kiln(registry, "rollback", "m")
    assert back.returncode == 0 and _champion(client) == "1", back.stderr
    assert model_registry.history(client, "m")[-1] == {**model_registry.history(client, "m")[-1],
                                                       "action": "rollback", "version": "1", "previous": "2"}


def test_rollback_to_a_version_that_never_passed_is_refused(registry):
    proc = _kiln(registry, "rollback", "m", "--to", "3")
    assert proc.returncode == 2 and "m v3 did not pass" in proc.stderr and "Inconclusive" in proc.stderr, proc.stderr
    assert _champion(registry.client) != "3"


def test_challenger_goes_only_to_a_version_whose_run_passed(registry, tmp_path):
    client = registry.client
    ctx = SimpleNamespace(tracker=SimpleNamespace(client=client, uri=registry.uri), cache=tmp_path, run_dir=tmp_path,
                          parent_run=registry.runs["3"], recipe=SimpleNamespace(tracking=SimpleNamespace(registered_model="m")))
    inconclusive = GateOutcome(Verdict.INCONCLUSIVE, [], ExitCode.GATE_INCONCLUSIVE, "rule")
    model_registry.complete(ctx, model_registry.Version("m", "3", reused=True), inconclusive)
    with pytest.raises(Exception, match="alias"):
        client.get_model_version_by_alias("m", "challenger")
    assert client.get_model_version("m", "3").tags["kiln.passed"] == "false"
    passed = GateOutcome(Verdict.INCONCLUSIVE, [], ExitCode.PASSED, "rule")  # on_inconclusive: pass
    model_registry.complete(ctx, model_registry.Version("m", "1", reused=True), passed)
    assert str(client.get_model_version_by_alias("m", "challenger").version) == "1"


def test_an_alias_does_not_outlive_its_verdict(registry, tmp_path):
    """A rerun of v1 that does not pass takes `challenger` off it; `champion` stays (moving it is the team's
    call) and kiln says so wherever the version is shown."""
    client = registry.client
    version, run = attested_version(client, client.get_experiment_by_name("aliases").experiment_id, "m", "Successful", 0)
    ctx = SimpleNamespace(tracker=SimpleNamespace(client=client, uri=registry.uri), cache=tmp_path, run_dir=tmp_path,
                          parent_run=run, recipe=SimpleNamespace(tracking=SimpleNamespace(registered_model="m")))
    model_registry.complete(ctx, model_registry.Version("m", version, reused=True),
                            GateOutcome(Verdict.SUCCESSFUL, [], ExitCode.PASSED, "rule"))
    client.set_registered_model_alias("m", "champion", version)
    failed = GateOutcome(Verdict.FAILED, [], ExitCode.GATE_FAILED, "rule")
    warning = model_registry.champion_warning_after(client, model_registry.Version("m", version, True), failed)
    assert warning and "still holds `champion`" in warning and "kiln rollback m" in warning
    model_registry.complete(ctx, model_registry.Version("m", version, reused=True), failed)
    with pytest.raises(Exception, match="alias"):
        client.get_model_version_by_alias("m", "challenger")
    assert _champion(client) == version
    shown = _kiln(registry, "verify", "m", version)
    assert "still holds `champion`" in shown.stdout, shown.stdout + shown.stderr


def _run_folder(registry, root: Path, version: str, verdict: str, code: int) -> Path:
    d = root / f"run-v{version}"
    d.mkdir(parents=True)
    # render needs a check Prometheus can evaluate (error_rate), which needs a stage that measures it (load)
    recipe = {**TINY_RECIPE, "model": {"path": "demo"}, "tracking": {"uri": registry.uri, "registered_model": "m"},
              "evaluate": {**TINY_RECIPE["evaluate"], "load": {"shape": {"kind": "constant", "rate": 1.0}}},
              "gate": {"checks": [*TINY_RECIPE["gate"]["checks"], {"kind": "error_rate", "max": 0.01}]}}
    (d / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (d / "state.json").write_text(json.dumps({"status": "done", "verdict": verdict, "exit_code": code,
                                              "mlflow_parent": registry.runs[version]}))
    (d / "registry.json").write_text(json.dumps({"name": "m", "version": version, "alias": "challenger"}))
    return d


def test_deploy_canary_and_render_refuse_a_run_that_did_not_pass(registry, tmp_path):
    failed = _run_folder(registry, tmp_path, "3", "Inconclusive", 3)
    proc = kiln("deploy", "canary", str(failed), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "m v3 did not pass" in proc.stderr and registry.runs["3"] in proc.stderr and "Traceback" not in proc.stderr
    recipe = failed / "recipe.yaml"
    out = tmp_path / "rollout.yaml"
    proc = kiln("deploy", "render", str(recipe), "--model-version", "3", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "m v3 did not pass" in proc.stderr and not out.exists(), proc.stderr
    proc = kiln("deploy", "render", str(recipe), "--model-version", "1", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    # each pod checks the version's signed verdict against the engine it is about to serve, before serving
    rollout = next(d for d in yaml.safe_load_all(out.read_text()) if d and d["kind"] == "Rollout")
    init = rollout["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][:3] == ["verify", "m", "1"] and "--engine" in init["args"], init
    proc = kiln("deploy", "render", str(recipe), "--model-version", "3", "--force", "--reason", "load test only",
                "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    overrides = json.loads(registry.client.get_model_version("m", "3").tags[model_registry.OVERRIDES])
    assert overrides[-1]["action"] == "deploy render" and overrides[-1]["reason"] == "load test only"
    # Forced once is not forced forever: a plain promote of the same version is still refused, and the
    # render's reason never appears as a promotion's.
    plain = _kiln(registry, "promote", "m", "3")
    assert plain.returncode == 2 and "m v3 did not pass" in plain.stderr, plain.stdout + plain.stderr
    assert all(e.get("forced") != "load test only" for e in model_registry.history(registry.client, "m"))
