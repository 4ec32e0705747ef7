"""Performance checks: ratios to the baseline or absolute SLOs, with intervals across paired samples.

Baseline and candidate are measured in interleaved pairs (A B, B A, …): the decode benchmark's
pairs are one prompt on each arm back to back, the load stage's are whole repeats of the load
shape. Sample i of each arm saw the same machine state. The ratio is estimated from the paired
log-ratios with a Student-t interval; a single pair has no interval and cannot pass, and a load
check whose client fell behind its schedule measured the client, not the server: both are
Inconclusive on too little data (`insufficient`), which no `on_inconclusive` accepts.

Pairing cancels what both arms of a pair share: drift, and steady load from other jobs (a shared
CI runner's). What it cannot cancel is load that changed between a pair's two halves. The decode
benchmark records CPU pressure and steal over each arm's half of every pair
(kiln.evaluate.contention), and a check drops the pairs whose halves differ by more than the
recipe's bounds, or whose halves both had a task waiting nearly all the time (saturated: a change
cannot be seen there); it is Inconclusive when more than half were dropped or fewer than two
remain. An absolute check (an SLO on the candidate alone) has nothing paired to cancel load, so its
samples are held to the bounds themselves. A benchmark that recorded no per-pair figures (an
older kiln's) is held to the bounds over its whole run. Every verdict of such a check says how busy
the machine was, by which signal, how many pairs were dropped, and whether the recipe switched the
guard off.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.metrics import BENCH_STEAL, CLIENT_LIMITED, LOAD_PREFIX, PRESSURE_BY_SIGNAL, metric
from kiln.core.units import amount
from kiln.core.verdict import percent


class PerformanceCheckConfig(CheckConfig):
    reads: ClassVar[str] = "performance"
    kind: Literal["performance"] = "performance"
    min_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at least this")
    max_ratio: float | None = Field(None, gt=0, description="candidate / baseline must be at most this")
    min: float | None = Field(None, description="absolute lower bound on the candidate (an SLO)")
    max: float | None = Field(None, description="absolute upper bound on the candidate (an SLO)")
    max_cpu_pressure: float | None = Field(
        0.25, ge=0, le=1, description="decode-benchmark checks: a pair whose two halves' CPU pressure (share of "
        "time a task waited for a CPU) differs by more than this is dropped, as is one saturated in both "
        "halves; Inconclusive when more than half are dropped. An absolute check (min/max) drops each sample "
        "measured above it. Steady load is judged: both arms of a pair shared it. null: never. Measured here: "
        "quiet 0.5-5%, one competing busy process on 2 cores 49%, two 99%")
    max_cpu_steal: float | None = Field(
        0.10, ge=0, le=1, description="decode-benchmark checks: as max_cpu_pressure, for the share of CPU time "
        "the hypervisor gave other guests (steal): a pair whose halves differ by more is dropped; null: never. "
        "Measured here: 0.02% on a VM with its own cores, 2.2-2.4% over a whole bench on a shared one "
        "(0-10% per engine)")

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
                                   baseline=base_value, threshold=self.threshold())
        limited = {ev.role: ev.counts[CLIENT_LIMITED] for ev in (candidate, baseline)
                   if c.metric.startswith(LOAD_PREFIX) and ev.counts.get(CLIENT_LIMITED, (0, 0))[0]}
        if limited:  # nothing of the server was measured
            return self.too_little("the load generator fell behind its schedule (client-limited) in "
                                   + ", ".join(f"{n} of {k} {role} repeats" for role, (n, k) in limited.items())
                                   + ": the figures measure the client, not the server. Lower the rate or "
                                     "run the load generator on a less busy machine",
                                   observed=observed, baseline=base_value, threshold=self.threshold())
        bench = not c.metric.startswith(LOAD_PREFIX)  # the decode benchmark's: the load stage records no contention
        keep, dropped = np.ones(n, dtype=bool), ""
        if bench:
            guarded = self._guard(candidate, baseline, relative, n)
            if isinstance(guarded, CheckResult):
                return guarded
            keep, dropped = guarded
        kept = int(keep.sum())
        if relative:
            log_ratio = np.log(cand[:n][keep] / base[:n][keep])
            mean, lo, hi = (math.exp(v) for v in t_interval(log_ratio, self.confidence))
            verdict = bounded_verdict(lo, hi, c.min_ratio, c.max_ratio)
            method = f"paired log-ratio t-interval over {kept}{f' of {n}' if kept < n else ''} interleaved pairs"
        else:
            mean, lo, hi = t_interval(cand[:n][keep], self.confidence)
            verdict = bounded_verdict(lo, hi, c.min, c.max)
            method = f"t-interval over {kept}{f' of {n}' if kept < n else ''} repeats"
        shown = (lambda v: f"{v:.3g}") if relative else (lambda v: amount(c.metric, v))  # 17.1 tok/s, 176.6 ms
        return self.result(verdict, observed=mean, baseline=base_value if not relative else 1.0,
                           threshold=self.threshold(), ci=(lo, hi), method=method,
                           reason=f"{'ratio' if relative else 'value'} {shown(mean)} "
                                  f"[{shown(lo)}, {shown(hi)}] at {percent(self.confidence)}"
                                  + (f"; {contention(candidate.metrics)}{'; ' + dropped if dropped else ''}"
                                     f"{_guard_off(c)}" if bench else ""))

    def _guard(self, candidate: Evidence, baseline: Evidence, relative: bool,
               n: int) -> tuple[np.ndarray, str] | CheckResult:
        """The decode benchmark's contention guard: the pairs (an absolute check's samples) it keeps and
        what it dropped, in words; or Inconclusive, when the load changed in too many pairs or, with no
        per-pair record (an older kiln's benchmark), the whole run was past the bounds."""
        c: PerformanceCheckConfig = self.config  # type: ignore[assignment]
        fields = {"observed": candidate.metrics.get(c.metric), "baseline": baseline.metrics.get(c.metric),
                  "threshold": self.threshold()}
        steady = steady_pairs(c, candidate.repeats, baseline.repeats if relative else None, n)
        if steady is None:
            if busy := _busy(c, candidate.metrics):
                return self.result(Verdict.INCONCLUSIVE, **fields,
                                   reason=f"measured on a busy machine: {busy}, with no per-pair record to tell "
                                          "steady load from a change; contention slows the two arms unequally. "
                                          "Re-measure: kiln run --fresh benchmark")
            return np.ones(n, dtype=bool), ""
        keep, dropped = steady
        if keep.sum() < 2 or (~keep).sum() > MAX_DROPPED * n:
            return self.result(Verdict.INCONCLUSIVE, **fields,
                               reason=f"the machine's load changed while measuring: {dropped}, more than "
                                      f"{MAX_DROPPED:.0%} may be; {contention(candidate.metrics)}. Re-measure "
                                      "when the load is steadier: kiln run --fresh benchmark")
        return steady

    def threshold(self) -> str:
        """The bound as the checks table shows it ("ratio ≥ 2")."""
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


# Both halves of a pair had a task waiting at least this share of the time: the pressure cannot rise
# further, so a change of load within the pair would not show (two busy processes beside a 2-thread
# engine on 2 cores read 99-100%).
SATURATED = 0.95
MAX_DROPPED = 0.5  # more of the pairs dropped than this: the load was too unsteady to trust the rest


def steady_pairs(c: PerformanceCheckConfig, cand: dict[str, list[float]], base: dict[str, list[float]] | None,
                 n: int) -> tuple[np.ndarray, str] | None:
    """Which of the first `n` pairs (samples, for an absolute check: `base` None) the contention guard
    keeps, and what it dropped, in words. The decode benchmark records each arm's CPU pressure and
    steal over its half of every pair (kiln.evaluate.decode_bench); None when it recorded none."""
    pressure = next((m for m in PRESSURE_BY_SIGNAL.values() if m in cand), None)
    arms = [cand] if base is None else [cand, base]
    if pressure is None or any(len(arm.get(pressure, [])) < n for arm in arms):
        return None
    keep, why = np.ones(n, dtype=bool), []
    for name, bound, what in ((pressure, c.max_cpu_pressure, "CPU pressure"), (BENCH_STEAL, c.max_cpu_steal, "steal")):
        if bound is None or any(len(arm.get(name, [])) < n for arm in arms):
            continue
        x = np.asarray(cand[name][:n], dtype=float)
        if base is None:
            bad = [(x > bound, f"{what} above {bound:.0%}")]
        else:
            y = np.asarray(base[name][:n], dtype=float)
            changed = np.abs(x - y) > bound
            bad = [(changed, f"{what} changed by more than {bound:.0%} between the arms' halves")]
            if name == pressure:
                bad.append(((x >= SATURATED) & (y >= SATURATED) & ~changed,
                            f"both halves saturated (a task waiting {SATURATED:.0%}+ of the time: a change cannot show)"))
        for mask, label in bad:
            if (mask & keep).any():
                why.append(f"{int((mask & keep).sum())} {label}")
            keep &= ~mask
    unit = "pairs" if base is not None else "samples"
    return keep, f"{n - int(keep.sum())} of {n} {unit} dropped" + (f" ({'; '.join(why)})" if why else "")


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
