"""Performance checks: ratios to the baseline or absolute SLOs, with intervals across paired samples.

Baseline and candidate are measured in interleaved pairs (A B, B A, …): the decode benchmark's
pairs are one prompt on each arm back to back, the load stage's are whole repeats of the load
shape. Sample i of each arm saw the same machine state. The ratio is estimated from the paired
log-ratios with a Student-t interval; a single pair has no interval and cannot pass, and a load
check whose client fell behind its schedule measured the client, not the server: both are
Inconclusive on too little data (`insufficient`), which no `on_inconclusive` accepts.

Interleaving cancels drift, not contention: a decode-benchmark check measured while tasks waited
for a CPU, or while the hypervisor took the CPU away (steal), past the recipe's bounds is
Inconclusive (kiln.evaluate.contention). Every other verdict of such a check says how busy the
machine was, by which signal, and whether the recipe switched the guard off.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.metrics import BENCH_STEAL, CLIENT_LIMITED, LOAD_PREFIX, PRESSURE_BY_SIGNAL, metric
from kiln.core.verdict import percent


class PerformanceCheckConfig(CheckConfig):
    reads: ClassVar[str] = "performance"
    kind: Literal["performance"] = "performance"
    min_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at least this")
    max_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at most this")
    min: float | None = Field(None, description="absolute lower bound on the candidate (an SLO)")
    max: float | None = Field(None, description="absolute upper bound on the candidate (an SLO)")
    max_cpu_pressure: float | None = Field(
        0.25, ge=0, le=1, description="decode-benchmark checks: Inconclusive when the machine's CPU pressure "
        "(share of time a task waited for a CPU) exceeded this while measuring; null: never. Measured here: "
        "quiet 0.5-5%, one competing busy process on 2 cores 49%, two 99%")
    max_cpu_steal: float | None = Field(
        0.10, ge=0, le=1, description="decode-benchmark checks: Inconclusive when the hypervisor gave other "
        "guests more than this share of the CPU time (steal) while measuring; null: never. Measured here: 0.02% "
        "on a VM with its own cores, 2.2-2.4% over a whole bench on a shared one (0-10% per engine)")

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
            return self.too_little(f"{n} repeat(s): an interval needs at least 2", observed=observed,
                                   baseline=base_value, threshold=self._threshold())
        limited = {ev.role: ev.counts[CLIENT_LIMITED] for ev in (candidate, baseline)
                   if c.metric.startswith(LOAD_PREFIX) and ev.counts.get(CLIENT_LIMITED, (0, 0))[0]}
        if limited:  # nothing of the server was measured
            return self.too_little("the load generator fell behind its schedule (client-limited) in "
                                   + ", ".join(f"{n} of {k} {role} repeats" for role, (n, k) in limited.items())
                                   + ": the figures measure the client, not the server. Lower the rate or "
                                     "run the load generator on a less busy machine",
                                   observed=observed, baseline=base_value, threshold=self._threshold())
        bench = not c.metric.startswith(LOAD_PREFIX)  # the decode benchmark's: the load stage records no contention
        if bench and (busy := _busy(c, candidate.metrics)):
            return self.result(Verdict.INCONCLUSIVE, observed=observed, baseline=base_value, threshold=self._threshold(),
                               reason=f"measured on a busy machine: {busy}; contention slows the two arms "
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
                                  f"[{lo:.3g}, {hi:.3g}] at {percent(self.confidence)}"
                                  + (f"; {contention(candidate.metrics)}{_guard_off(c)}" if bench else ""))

    def _threshold(self) -> str:
        c: PerformanceCheckConfig = self.config  # type: ignore[assignment]
        for key, sym in (("min_ratio", "ratio ≥"), ("max_ratio", "ratio ≤"), ("min", "≥"), ("max", "≤")):
            if getattr(c, key) is not None:
                return f"{sym} {getattr(c, key):g}"
        return ""


def machine(metrics: dict[str, float]) -> tuple[str | None, float | None, float | None]:
    """(signal, CPU pressure, steal) the decode benchmark recorded among an arm's metrics."""
    signal = next((sig for sig, name in PRESSURE_BY_SIGNAL.items() if name in metrics), None)
    return signal, metrics[PRESSURE_BY_SIGNAL[signal]] if signal else None, metrics.get(BENCH_STEAL)


def contention(metrics: dict[str, float]) -> str:
    """How busy the machine was while the decode benchmark ran, as the report shows it beside a speed."""
    signal, pressure, steal = machine(metrics)
    return ("CPU pressure " + (f"{pressure:.1%} ({signal})" if pressure is not None else
                               "not measured (no PSI, no run queue in /proc)")
            + ", steal " + (f"{steal:.1%}" if steal is not None else "not measured"))


def _busy(c: PerformanceCheckConfig, metrics: dict[str, float]) -> str | None:
    signal, pressure, steal = machine(metrics)
    if c.max_cpu_pressure is not None and pressure is not None and pressure > c.max_cpu_pressure:
        return (f"tasks waited for a CPU {pressure:.0%} of the time ({signal}; "
                f"max_cpu_pressure {c.max_cpu_pressure:.0%})")
    if c.max_cpu_steal is not None and steal is not None and steal > c.max_cpu_steal:
        return (f"the hypervisor gave other guests {steal:.0%} of the CPU time (steal; "
                f"max_cpu_steal {c.max_cpu_steal:.0%})")
    return None


def _unguarded(c: PerformanceCheckConfig) -> str:
    """"max_cpu_pressure and max_cpu_steal", the bounds a recipe set to null, or ""."""
    return " and ".join(name for name in ("max_cpu_pressure", "max_cpu_steal") if getattr(c, name) is None)


def _guard_off(c: PerformanceCheckConfig) -> str:
    return f" (not guarded: the recipe sets {off}: null)" if (off := _unguarded(c)) else ""


def guard_warnings(checks: list[CheckConfig], metrics: dict[str, float]) -> list[str]:
    """What a report warns about: decode-benchmark speed checks the recipe left unguarded against a
    busy machine, and a benchmark that had no signal of CPU pressure (`metrics`: the candidate's)."""
    bench = [c for c in checks if isinstance(c, PerformanceCheckConfig) and not c.metric.startswith(LOAD_PREFIX)]
    out = [f"contention guard off for {c.label}: the recipe sets {off}: null, so its speed verdict stands "
           "however busy the machine was" for c in bench if (off := _unguarded(c))]
    if bench and any(c.metric in metrics for c in bench) and machine(metrics)[1] is None:
        out.append("the decode benchmark could not measure CPU pressure on this machine (no PSI, no run queue in "
                   "/proc): its speed verdicts are unguarded against other jobs")
    return out
