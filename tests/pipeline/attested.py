"""Registered versions as kiln's publish leaves them, made directly on a real tracking server: an artifact
uploaded under the run's `model/`, a version whose source is it, the run's signed verdict
(kiln.pipeline.provenance.attestation) on the run, and the tags `complete` sets. The registry tests judge the
commands that read them (promote, rollback, deploy, verify), not a pipeline run."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from kiln.core import signing
from kiln.core.files import atomic_write_json
from kiln.pipeline.provenance import attestation
from kiln.pipeline.tracking import registry as model_registry


def attested_version(client: Any, experiment: str, name: str, verdict: str, code: int, policy_sha256: str = "p" * 64,
                     weights: bytes = b"judged weights", key: Any = None) -> tuple[str, str]:
    """A complete version of `name` whose run ended `verdict` (exit `code`), signed with `key` (default: kiln's own).
    Returns (version, run id)."""
    run = client.create_run(experiment, run_name=f"{name} {verdict}")
    run_id = run.info.run_id
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        (model / "model.safetensors").write_bytes(weights)
        (model / "config.json").write_text("{}")
        client.log_artifacts(run_id, str(model), "model")
        mv = client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run_id)
        predicate = {"verdict": verdict, "exit_code": code, "passed": code == 0, "summary": "", "checks": [],
                     "policy_sha256": policy_sha256, "registered_model": {"name": name, "version": str(mv.version)},
                     "run": {"name": "r", "mlflow_run": run_id}, "evidence": []}
        stmt = signing.statement(attestation.file_subjects(model, attestation.MODEL), attestation.VERDICT_TYPE, predicate)
        envelope = Path(tmp) / attestation.ENVELOPE
        atomic_write_json(envelope, signing.sign(stmt, key))
        client.log_artifact(run_id, str(envelope))
    tags = {model_registry.STATE: "complete", "kiln.verdict": verdict, model_registry.PASSED: str(code == 0).lower(),
            "kiln.exit_code": str(code), "kiln.last_run": run_id, attestation.ATTESTATION_RUN: run_id}
    for k, v in tags.items():
        client.set_model_version_tag(name, mv.version, k, v)
    return str(mv.version), run_id
