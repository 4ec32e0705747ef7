"""Error-rate check: failed requests over all requests, with an exact (Clopper-Pearson) interval."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.gate.performance import bounded_verdict


class ErrorRateCheckConfig(CheckConfig):
    reads: ClassVar[str] = "error_rate"
    kind: Literal["error_rate"] = "error_rate"
    metric: Literal["error_rate"] = "error_rate"
    max: float = Field(ge=0, le=1, description="highest acceptable error rate")


@CHECKS.register("error_rate", ErrorRateCheckConfig)
class ErrorRateCheck(Check):
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        from scipy import stats

        c: ErrorRateCheckConfig = self.config  # type: ignore[assignment]
        errors, trials = candidate.counts.get("error_rate", (0, 0))
        if trials == 0:
            return self.too_little("no requests observed", observed=None, baseline=None, threshold=f"≤ {c.max:g}")
        ci = stats.binomtest(errors, trials).proportion_ci(self.confidence, method="exact")
        b_err, b_trials = baseline.counts.get("error_rate", (0, 0))
        return self.result(bounded_verdict(ci.low, ci.high, None, c.max), observed=errors / trials,
                           baseline=b_err / b_trials if b_trials else None, threshold=f"≤ {c.max:g}",
                           ci=(ci.low, ci.high), method=f"Clopper-Pearson on {errors}/{trials}",
                           reason=f"{errors} errors in {trials} requests")
