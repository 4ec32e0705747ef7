"""The registry trusts signed verdicts, not tags: tried as a teammate with write access to the shared
tracking server would (a real `mlflow server` on 127.0.0.1). Each attack here reached `champion` before
verdicts were attestations; each must now be refused by `kiln promote`, naming what does not hold."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from kiln.core import signing
from kiln.pipeline.tracking import registry as model_registry
from tests.pipeline.attested import attested_version
from tests.pipeline.conftest import kiln, write_recipe
from tests.tracking_servers import mlflow_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("provenance")
    with mlflow_server(work) as uri:
        client = MlflowClient(uri)
        yield SimpleNamespace(uri=uri, client=client, work=work, exp=client.create_experiment("provenance"))


def _kiln(server, *args: str):
    return kiln(*args, "--tracking-uri", server.uri, cwd=server.work)


def _model(server, name: str) -> str:
    server.client.create_registered_model(name)
    return name


def test_a_failed_verdict_with_forged_tags_is_still_refused(server):
    name = _model(server, "forged-tags")
    version, _ = attested_version(server.client, server.exp, name, "Failed", 1)
    for key, value in {"kiln.passed": "true", "kiln.verdict": "Successful", "kiln.exit_code": "0"}.items():
        server.client.set_model_version_tag(name, version, key, value)  # what the teammate can write
    proc = _kiln(server, "promote", name, version)
    assert proc.returncode == 2 and f"{name} v{version} did not pass" in proc.stderr, proc.stdout + proc.stderr
    assert "Failed" in proc.stderr


def test_weights_replaced_in_the_store_after_the_verdict_are_refused(server):
    name = _model(server, "swapped-weights")
    version, run_id = attested_version(server.client, server.exp, name, "Successful", 0)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model.safetensors").write_bytes(b"weights nobody judged")
        server.client.log_artifacts(run_id, tmp, "model")  # the same path, other bytes
    proc = _kiln(server, "promote", name, version)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "model/model.safetensors has changed since it was judged" in proc.stderr
    assert _kiln(server, "verify", name, version).returncode == 5


def test_a_verdict_signed_by_a_key_nobody_trusts_is_refused(server, tmp_path):
    name = _model(server, "untrusted-key")
    stranger = signing.new_key(tmp_path / "stranger.pem")
    version, _ = attested_version(server.client, server.exp, name, "Successful", 0, key=stranger)
    proc = _kiln(server, "promote", name, version)
    assert proc.returncode == 5 and "does not trust" in proc.stderr, proc.stdout + proc.stderr
    trusted = tmp_path / "stranger.pub"
    trusted.write_text(signing.public_pem(stranger.public_key()))
    ok = kiln("promote", name, version, "--tracking-uri", server.uri, cwd=server.work,
              env={signing.TRUSTED_KEYS_ENV: str(trusted)})
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_an_attestation_edited_after_signing_is_refused(server, tmp_path):
    import base64

    name = _model(server, "edited-attestation")
    version, run_id = attested_version(server.client, server.exp, name, "Failed", 1)
    local = Path(server.client.download_artifacts(run_id, "attestation.dsse.json", str(tmp_path)))
    envelope = json.loads(local.read_text())
    stmt = json.loads(base64.b64decode(envelope["payload"]))
    stmt["predicate"].update(verdict="Successful", exit_code=0, passed=True)
    envelope["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    local.write_text(json.dumps(envelope))
    server.client.log_artifact(run_id, str(local))
    proc = _kiln(server, "promote", name, version)
    assert proc.returncode == 5 and "does not match its content" in proc.stderr, proc.stdout + proc.stderr


def test_a_version_with_no_attestation_is_refused(server):
    name = _model(server, "hand-made")
    run = server.client.create_run(server.exp)
    mv = server.client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    for key, value in {"kiln.registration": "complete", "kiln.passed": "true", "kiln.verdict": "Successful"}.items():
        server.client.set_model_version_tag(name, mv.version, key, value)
    proc = _kiln(server, "promote", name, str(mv.version))
    assert proc.returncode == 5 and "no attestation recorded" in proc.stderr, proc.stdout + proc.stderr


def test_a_verdict_under_another_policy_than_the_pinned_one_is_refused(server, tmp_path, tiny_model_dir):
    name = _model(server, "pinned")
    recipe = write_recipe(tmp_path / "strict.yaml", tiny_model_dir, tracking={"registered_model": name,
                                                                             "uri": server.uri})
    no_reason = _kiln(server, "policy", "set", name, str(recipe))
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    pinned = _kiln(server, "policy", "set", name, str(recipe), "--reason", "the team's gate")
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    version, _ = attested_version(server.client, server.exp, name, "Successful", 0, policy_sha256="e" * 64)
    proc = _kiln(server, "promote", name, version)
    assert proc.returncode == 5 and f"{name} pins" in proc.stderr, proc.stdout + proc.stderr


def test_a_looser_recipe_cannot_register_under_a_pinned_model(server, tmp_path, tiny_model_dir):
    """The issue's second recipe: `tracking.registered_model` of a model whose gate refused the artifact, and a
    looser gate. It stops before any work (exit 2), naming the pinned policy and the ways forward."""
    name = _model(server, "first-model")
    strict = write_recipe(tmp_path / "strict.yaml", tiny_model_dir, tracking={"registered_model": name, "uri": server.uri})
    assert _kiln(server, "policy", "set", name, str(strict), "--reason", "first gate").returncode == 0
    loose = write_recipe(tmp_path / "loose.yaml", tiny_model_dir, name="loose",
                         tracking={"registered_model": name, "uri": server.uri},
                         gate={"on_inconclusive": "pass", "checks": [{"kind": "size", "max_ratio": 10.0}]})
    proc = kiln("run", str(loose), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "is judged under policy" in proc.stderr and "kiln policy set" in proc.stderr
    assert not list((tmp_path / "runs").glob("*/stages/*.json")), "no stage may run under a refused policy"


def test_a_pin_edited_on_the_server_is_not_trusted(server, tmp_path, tiny_model_dir):
    name = _model(server, "edited-pin")
    strict = write_recipe(tmp_path / "strict.yaml", tiny_model_dir, tracking={"registered_model": name, "uri": server.uri})
    assert _kiln(server, "policy", "set", name, str(strict), "--reason", "first gate").returncode == 0
    pin = json.loads(server.client.get_registered_model(name).tags[model_registry.PIN])
    pin["signatures"][0]["keyid"] = "0" * 64  # or any other change the teammate makes
    server.client.set_registered_model_tag(name, model_registry.PIN, json.dumps(pin))
    proc = kiln("run", str(strict), cwd=tmp_path)
    assert proc.returncode == 5 and "policy pin" in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_verify_with_a_models_name_alone_says_to_name_the_version(server):
    """`kiln verify NAME` without a version is read as a run; none by that name says how to verify the model."""
    name = _model(server, "name-alone")
    attested_version(server.client, server.exp, name, "Successful", 0)
    proc = _kiln(server, "verify", name)
    assert proc.returncode == 2 and f"kiln verify {name} VERSION" in proc.stderr, proc.stdout + proc.stderr
