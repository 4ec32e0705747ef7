"""The canary walk in MLflow: `MlflowJournal`, the journal `kiln deploy canary` passes to the
controller (kiln.deploy.journal states the contract; deploy/ knows no tracking server).

The walk is one run (tag kiln.stage=canary, under the candidate's pipeline run when given) with
a child run per step (tags kiln.stage=canary-step, kiln.weight, kiln.verdict, kiln.action; each
check's estimate and confidence sequence as metrics; the step's evidence as `evidence.json`).
The registry follows the outcome: the version walking is the `challenger` unless named, a
promotion moves `champion` to it (`model_registry.promote`, which remembers the one it replaces),
and the version is tagged `kiln.deploy=<status>` either way.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.deploy.base import Observations
from kiln.deploy.canary import Controller
from kiln.deploy.config import DeployConfig
from kiln.deploy.journal import CanaryJournal, CanaryResult, StepRecord
from kiln.core.errors import ExitCode
from kiln.core.files import atomic_write_json
from kiln.core.gate.policy import GateSection
from kiln.core.stats import jsonable
from kiln.pipeline.tracking.registry import CHALLENGER, promote
from kiln.pipeline.tracking.runs import Tracker


class MlflowJournal(CanaryJournal):
    """Records a walk through `tracker`; settles `model`'s `version` in the registry when `model` is
    given (`version` defaults to the one holding alias 'challenger'). `parent_run_id`: the
    pipeline run the walk's run nests under."""

    def __init__(self, tracker: Tracker, model: str | None = None, version: str | None = None,
                 parent_run_id: str | None = None, forced: str | None = None):
        super().__init__(model, version)
        self.tracker, self.parent_run_id, self.forced = tracker, parent_run_id, forced
        self.run_id: str | None = None

    def resolve(self) -> None:
        if self.model and self.version is None:
            self.version = str(self.tracker.client.get_model_version_by_alias(self.model, CHALLENGER).version)

    def start(self, deploy: DeployConfig, policy: GateSection) -> str | None:
        tags = {"kiln.stage": "canary", "kiln.model": self.model or "", "kiln.version": self.version or ""}
        self.run_id = self.tracker.start("canary", tags, parent=self.parent_run_id)
        self.tracker.log(self.run_id, params={"steps": json.dumps([s.model_dump() for s in deploy.steps]),
                                              "on_inconclusive": deploy.on_inconclusive,
                                              "gate": json.dumps(policy.model_dump(mode="json"))})
        return self.run_id

    def step(self, record: StepRecord, window: Observations) -> str | None:
        if not self.run_id:
            return None
        t = self.tracker
        tags = {"kiln.stage": "canary-step", "kiln.weight": f"{record.weight:g}", "kiln.verdict": record.verdict,
                "kiln.action": record.action}
        run_id = t.start(f"canary-step-{record.index + 1}-{record.weight:g}pct", tags, parent=self.run_id)
        t.log(run_id, metrics=_step_metrics(record) | {"seconds": record.seconds},
              params={"weight": record.weight, "reason": record.reason[:5000]})
        candidate, baseline = window.evidence()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "evidence.json"
            atomic_write_json(path, jsonable({"step": asdict(record) | {"run_id": None},
                                              "candidate": asdict(candidate), "baseline": asdict(baseline)}))
            t.log_artifacts(run_id, path)
        t.end(run_id)
        return run_id

    def settle(self, status: str) -> None:
        """Move 'champion' to the version on promotion; tag the version with the outcome either way."""
        if not (self.model and self.version):
            return
        client = self.tracker.client
        if status == "promoted":  # remembers the champion it replaces, so `kiln rollback` can restore it
            promote(client, self.model, self.version, self.forced)  # the walk's own --force reason, if any
        client.set_model_version_tag(self.model, self.version, "kiln.deploy", status)

    def finish(self, result: CanaryResult) -> None:
        if not self.run_id:
            return
        self.tracker.log(self.run_id, metrics={"steps_completed": len(result.steps)},
                         tags={"kiln.verdict": result.status, "kiln.reason": result.reason[:5000]})
        self.tracker.end(self.run_id, "FINISHED" if result.exit_code != ExitCode.INTERNAL_ERROR else "FAILED")


def _step_metrics(record: StepRecord) -> dict[str, float]:
    """Per-arm summaries, and every check's estimate and confidence-sequence bounds."""
    metrics = {f"stable.{k}": v for k, v in record.stable.items()} | {f"canary.{k}": v for k, v in record.canary.items()}
    for c in record.checks:
        if c["observed"] is not None:
            metrics[f"check.{c['name']}.estimate"] = c["observed"]
        if c["ci"]:
            metrics[f"check.{c['name']}.cs_low"], metrics[f"check.{c['name']}.cs_high"] = c["ci"]
    return metrics


def canary_journal(tracking_uri: str | None = None, experiment: str = "kiln", model: str | None = None,
                   version: str | None = None, parent_run_id: str | None = None,
                   forced: str | None = None) -> CanaryJournal:
    """The journal for `kiln deploy canary`: MLflow when a tracking server or a registered model is
    named (the default store otherwise), else one that records nothing. `forced`: the walk's --force
    reason, which its promotion (and only it) goes ahead with."""
    if tracking_uri is None and model is None:
        return CanaryJournal(model, version)
    return MlflowJournal(Tracker(tracking_uri, experiment), model, version, parent_run_id, forced)


class TrackedController(Controller):
    """The controller recording to `tracker` (kiln.pipeline.tracking.runs.Tracker), when given, with
    `model`'s `version` settled in its registry; without one it records nothing."""

    def __init__(self, target: Any, policy: GateSection, deploy: DeployConfig, tracker: Tracker | None = None,
                 model: str | None = None, version: str | None = None, parent_run_id: str | None = None,
                 **kwargs: Any):
        journal = MlflowJournal(tracker, model, version, parent_run_id) if tracker else CanaryJournal(model, version)
        super().__init__(target, policy, deploy, journal, **kwargs)
