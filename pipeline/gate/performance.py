"""Performance checks: ratios to the baseline or absolute SLOs, with intervals across paired samples.

Baseline and candidate are measured in interleaved pairs (A B, B A, …): the decode benchmark's
pairs are one prompt on each arm back to back, the load stage's are whole repeats of the load
shape. Sample i of each arm saw the same machine state. The ratio is estimated from the paired
log-ratios with a Student-t interval; a single pair has no interval and cannot pass.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from kiln.pipeline.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.pipeline.metrics import BENCH_PRESSURE, CLIENT_LIMITED, LOAD_PREFIX, metric


class PerformanceCheckConfig(CheckConfig):
    kind: Literal["performance"] = "performance"
    min_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at least this")
    max_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at most this")
    min: float | None = Field(None, description="absolute lower bound on the candidate (an SLO)")
    max: float | None = Field(None, description="absolute upper bound on the candidate (an SLO)")
    max_cpu_pressure: float | None = Field(
        0.25, ge=0, le=1, description="decode-benchmark checks: Inconclusive when the machine's CPU pressure "
        "(share of time a task waited for a CPU) exceeded this while measuring; null: never. Measured here: "
        "quiet 0.5-5%, one competing busy process on 2 cores 49%, two 99%")

    @model_validator(mode="after")
    def _one_bound(self) -> PerformanceCheckConfig:
        bounds = [b for b in ("min_ratio", "max_ratio", "min", "max") if getattr(self, b) is not None]
        if len(bounds) != 1:
            raise ValueError(f"set exactly one of min_ratio, max_ratio, min, max (got {bounds or 'none'})")
        return self


def t_interval(values: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Mean and two-sided Student-t interval."""
    from scipy import stats
    mean = float(values.mean())
    half = float(stats.t.ppf(0.5 + confidence / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return mean, mean - half, mean + half


def bounded_verdict(lo: float, hi: float, lower: float | None, upper: float | None) -> Verdict:
    """Successful when the whole interval satisfies the bound, Failed when none of it does."""
    if lower is not None:
        return Verdict.SUCCESSFUL if lo >= lower else Verdict.FAILED if hi < lower else Verdict.INCONCLUSIVE
    assert upper is not None
    return Verdict.SUCCESSFUL if hi <= upper else Verdict.FAILED if lo > upper else Verdict.INCONCLUSIVE


@CHECKS.register("performance", PerformanceCheckConfig)
class PerformanceCheck(Check):
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        c: PerformanceCheckConfig = self.config  # type: ignore[assignment]
        metric(c.metric, f"gate check {c.label}")
        cand = np.asarray(candidate.repeats.get(c.metric, []), dtype=float)
        base = np.asarray(baseline.repeats.get(c.metric, []), dtype=float)
        relative = c.min_ratio is not None or c.max_ratio is not None
        n = min(len(cand), len(base)) if relative else len(cand)
        observed = candidate.metrics.get(c.metric)
        base_value = baseline.metrics.get(c.metric)
        if n < 2:
            return self.result(Verdict.INCONCLUSIVE, observed=observed, baseline=base_value,
                               threshold=self._threshold(), reason=f"{n} repeat(s): an interval needs at least 2")
        limited = {ev.role: ev.counts[CLIENT_LIMITED] for ev in (candidate, baseline)
                   if c.metric.startswith(LOAD_PREFIX) and ev.counts.get(CLIENT_LIMITED, (0, 0))[0]}
        if limited:
            return self.result(Verdict.INCONCLUSIVE, observed=observed, baseline=base_value, threshold=self._threshold(),
                               reason="the load generator fell behind its schedule (client-limited) in "
                                      + ", ".join(f"{n} of {k} {role} repeats" for role, (n, k) in limited.items())
                                      + ": the figures measure the client, not the server. Lower the rate or "
                                        "run the load generator on a less busy machine")
        pressure = candidate.metrics.get(BENCH_PRESSURE) if not c.metric.startswith(LOAD_PREFIX) else None
        if c.max_cpu_pressure is not None and pressure is not None and pressure > c.max_cpu_pressure:
            return self.result(Verdict.INCONCLUSIVE, observed=observed, baseline=base_value, threshold=self._threshold(),
                               reason=f"measured on a busy machine: tasks waited for a CPU {pressure:.0%} of the time "
                                      f"(max_cpu_pressure {c.max_cpu_pressure:.0%}); other jobs slow the two arms "
                                      "unequally. Re-measure on a quieter machine: kiln run --fresh benchmark")
        if relative:
            log_ratio = np.log(cand[:n] / base[:n])
            mean, lo, hi = (math.exp(v) for v in t_interval(log_ratio, self.confidence))
            verdict = bounded_verdict(lo, hi, c.min_ratio, c.max_ratio)
            method = f"paired log-ratio t-interval over {n} interleaved pairs"
        else:
            mean, lo, hi = t_interval(cand, self.confidence)
            verdict = bounded_verdict(lo, hi, c.min, c.max)
            method = f"t-interval over {n} repeats"
        return self.result(verdict, observed=mean, baseline=base_value if not relative else 1.0,
                           threshold=self._threshold(), ci=(lo, hi), method=method,
                           reason=f"{'ratio' if relative else 'value'} {mean:.3g} "
                                  f"[{lo:.3g}, {hi:.3g}] at {self.confidence:.0%}")

    def _threshold(self) -> str:
        c: PerformanceCheckConfig = self.config  # type: ignore[assignment]
        for key, sym in (("min_ratio", "ratio ≥"), ("max_ratio", "ratio ≤"), ("min", "≥"), ("max", "≤")):
            if getattr(c, key) is not None:
                return f"{sym} {getattr(c, key):g}"
        return ""
