"""What a canary walk reports, and the registry moves it asks for: the `CanaryJournal` contract.

The controller (canary.py) knows no tracking server. It asks its journal which model version
walks, tells it that the walk started, how each step ended and how the walk ended, and asks it to
settle the version's outcome (promoted: the registry's `champion` moves to it; the outcome is
tagged on the version either way). This base records nothing: a walk with no tracking server,
and the simulations. `kiln.pipeline.tracking.canary_journal.MlflowJournal` records the walk as an MLflow
run with a child run per step and moves the registry's aliases; the orchestrator passes it in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.deploy.base import Observations
from kiln.deploy.config import DeployConfig
from kiln.core.errors import ExitCode
from kiln.core.gate.policy import GateSection
from kiln.core.stats import jsonable


@dataclass
class StepRecord:
    index: int
    weight: float
    verdict: str
    action: str  # advance | promote | rollback | hold
    reason: str
    seconds: float
    stable: dict[str, float]
    canary: dict[str, float]
    checks: list[dict[str, Any]]
    run_id: str | None = None


@dataclass
class CanaryResult:
    status: str  # promoted | rolled_back | held
    exit_code: ExitCode
    reason: str
    steps: list[StepRecord] = field(default_factory=list)
    skipped_checks: list[dict[str, str]] = field(default_factory=list)
    model: str | None = None
    version: str | None = None
    run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return jsonable({**asdict(self), "exit_code": int(self.exit_code)})


class CanaryJournal:
    """Records nothing; names the registered `model` and `version` walking, when given.
    Subclasses override what they record; the controller calls, in order: resolve, start, step
    (once per step), settle, finish."""

    def __init__(self, model: str | None = None, version: str | None = None):
        self.model, self.version = model, version

    def resolve(self) -> None:
        """Settle `version` before the walk (a journal with a registry: the challenger's)."""

    def start(self, deploy: DeployConfig, policy: GateSection) -> str | None:
        """The walk begins; returns the id it is recorded under (None: not recorded)."""
        return None

    def step(self, record: StepRecord, window: Observations) -> str | None:
        """A step ended with `record`, judged on `window`; returns the step's record id."""
        return None

    def settle(self, status: str) -> None:
        """The walk's outcome for the version: on 'promoted' it becomes the champion."""

    def finish(self, result: CanaryResult) -> None:
        """The walk ended with `result` (after `settle`)."""
