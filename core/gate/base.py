"""The gate-check contract: `check(candidate, baseline) -> CheckResult`, one file per kind.

A check's verdict is one of Successful, Failed, Inconclusive, Error, kept apart as Argo Rollouts
does: "the data cannot decide" is not "it regressed", and neither is "the check broke". An
Inconclusive check also says whether it measured nothing or too little to decide (`insufficient`:
no requests, one repeat, fewer items than could ever pass): `gate.on_inconclusive: pass` accepts an
undecided interval, never a check that had no data to decide on (kiln.core.gate.policy.combine).
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.verdict import Verdict
from kiln.core.registry import Registry

__all__ = ["CHECKS", "TOO_LITTLE", "Check", "CheckConfig", "CheckResult", "Evidence", "Verdict"]


@dataclass
class Evidence:
    """What one role (baseline or candidate) measured, as the checks read it.

    samples: metric -> {doc id: per-sample value}, joined on doc id for paired statistics.
    repeats: metric -> one value per interleaved repeat, for ratios with intervals.
    metrics: metric -> the aggregate point value shown in tables.
    """

    role: str
    metrics: dict[str, float] = field(default_factory=dict)
    samples: dict[str, dict[str, float]] = field(default_factory=dict)
    repeats: dict[str, list[float]] = field(default_factory=dict)
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # metric -> (events, trials)


# What an insufficient check's reason ends with, in the report and the pull-request comment.
TOO_LITTLE = " — too little data to decide, so it blocks even under `on_inconclusive: pass`"


@dataclass
class CheckResult:
    name: str
    kind: str
    metric: str
    verdict: Verdict
    observed: float | None
    baseline: float | None
    threshold: str
    ci: tuple[float, float] | None = None  # of the value, ratio or (quality) candidate - baseline
    drop: float | None = None  # quality checks: how much worse, positive = worse, in the margin's units
    drop_ci: tuple[float, float] | None = None  # ... and its interval, the quantity the threshold bounds
    p_value: float | None = None
    method: str = ""
    reason: str = ""
    items_needed: int | None = None
    insufficient: bool = False  # Inconclusive on nothing or too little: blocks whatever on_inconclusive says

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        d["ci"] = list(self.ci) if self.ci else None
        d["drop_ci"] = list(self.drop_ci) if self.drop_ci else None
        return d


class CheckConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reads: ClassVar[str]  # the kind of metric (kiln.core.metrics.Metric.kind) whose evidence the check reads
    kind: str
    metric: str
    name: str | None = Field(None, description="shown in reports; default '<kind>:<metric>'")
    confidence: float | None = Field(None, gt=0.5, lt=1, description="default: gate.confidence")

    @property
    def label(self) -> str:
        return self.name or f"{self.kind}:{self.metric}"


class Check(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: CheckConfig, confidence: float):
        self.config = config
        self.confidence = config.confidence or confidence

    @abc.abstractmethod
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult: ...

    def result(self, verdict: Verdict, **fields: Any) -> CheckResult:
        return CheckResult(name=self.config.label, kind=self.config.kind, metric=self.config.metric,
                           verdict=verdict, **fields)

    def too_little(self, reason: str, **fields: Any) -> CheckResult:
        """Inconclusive because the evidence held nothing or too little to decide: the result blocks."""
        return self.result(Verdict.INCONCLUSIVE, insufficient=True, reason=f"{reason}{TOO_LITTLE}", **fields)


CHECKS: Registry[Check] = Registry("gate check kind", "kind")
