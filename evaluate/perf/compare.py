"""Candidate-over-baseline ratios with intervals across interleaved repeats, never one number.

Each repeat runs the baseline and the candidate back to back under the same workload, so slow
drift of a shared machine hits both arms of a pair alike. The ratio of a pair is candidate /
baseline; across repeats we take the mean of log ratios and a Student-t interval on it
(exponentiated: a geometric-mean ratio with a 95% interval). With one repeat there is no
interval, and the comparison says so rather than inventing one.

`across_runs` is `kiln compare`'s gate: two runs' candidates were never measured as pairs, so a
relative speed check between them is not judged (below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.core.gate.base import CHECKS, CheckResult, Evidence
from kiln.core.gate.performance import PerformanceCheckConfig, steady_pairs
from kiln.core.gate.policy import GateOutcome, combine, judge, rule
from kiln.core.metrics import LOAD_PREFIX
from kiln.core.verdict import percent
from kiln.evaluate.perf.metrics import Summary

# (metric name, how to read it from a Summary, higher is better)
RATIO_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("output_token_throughput", "output_token_throughput", True),
    ("request_throughput", "request_throughput", True),
    ("goodput", "goodput", True),
    ("ttft_p50_ms", "ttft_ms.p50", False),
    ("ttft_p95_ms", "ttft_ms.p95", False),
    ("tpot_p50_ms", "tpot_ms.p50", False),
    ("tpot_p95_ms", "tpot_ms.p95", False),
    ("itl_p50_ms", "itl_ms.p50", False),
    ("e2e_p50_ms", "e2e_ms.p50", False),
)


def metric_value(summary: Summary, path: str) -> float:
    name, _, stat = path.partition(".")
    value = getattr(summary, name)
    return float(value[stat] if stat else value)


@dataclass
class RatioEstimate:
    metric: str
    higher_is_better: bool
    ratios: list[float]  # candidate / baseline, one per repeat
    ratio: float  # geometric mean
    low: float | None  # 95% interval; None with fewer than two finite ratios
    high: float | None


def ratio_interval(ratios: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """Geometric mean ratio and its Student-t interval on the log scale."""
    from scipy import stats

    logs = np.log([r for r in ratios if r > 0 and math.isfinite(r)])
    if len(logs) == 0:
        return float("nan"), None, None
    mean = float(logs.mean())
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = float(stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * logs.std(ddof=1) / math.sqrt(len(logs)))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def ratio_estimates(baseline: Sequence[Summary], candidate: Sequence[Summary]) -> list[RatioEstimate]:
    """One estimate per metric from paired summaries (repeat k of each arm)."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("need the same, non-zero number of baseline and candidate repeats")
    out = []
    for name, path, higher in RATIO_METRICS:
        ratios = []
        for a, b in zip(baseline, candidate):
            va, vb = metric_value(a, path), metric_value(b, path)
            ratios.append(vb / va if va > 0 and math.isfinite(va) and math.isfinite(vb) else float("nan"))
        ratio, low, high = ratio_interval(ratios)
        out.append(RatioEstimate(name, higher, ratios, ratio, low, high))
    return out


def format_ratios(estimates: Sequence[RatioEstimate]) -> str:
    """A plain-text table (the CLI can wrap it in rich)."""
    lines = [f"{'metric':<26}{'candidate/baseline':>20}{'95% interval':>22}  repeats"]
    for e in estimates:
        interval = f"[{e.low:.3f}, {e.high:.3f}]" if e.low is not None else "n/a (1 repeat)"
        lines.append(f"{e.metric:<26}{e.ratio:>20.3f}{interval:>22}  {', '.join(f'{r:.3f}' for r in e.ratios)}")
    return "\n".join(lines)


def across_runs(policy: Any, run_b: dict[str, Evidence], run_a: dict[str, Evidence], same_baseline: bool) -> GateOutcome:
    """RUN_B's candidate judged against RUN_A's by RUN_B's gate `policy` (`kiln compare`).

    Quality checks join the two runs' per-document samples on doc id, as within one run: the same
    documents, scored by the same deterministic code. Speed samples are not like that: each run
    paired its candidate with its baseline under that run's load, so sample i of one run has no
    partner in the other, and an arm's speed-up itself moves with the load (the demo's q4_1: 6.3x
    quiet, 3.0x beside two busy processes on 2 cores, bench/busy_verdict.py). Pairing them anyway
    read the same q8_0 file as 0.44x of itself. So a relative speed check across runs is
    Inconclusive (it blocks), saying why and how to measure the two as pairs; where both runs
    measured against the same baseline engine (`same_baseline`) it shows B over A through that
    baseline, as a figure, not a verdict."""
    outcome = judge(policy, run_b["candidate"], run_a["candidate"])
    results = [_unpaired(policy, cfg, run_b, run_a, same_baseline) if _relative_speed(cfg) else result
               for cfg, result in zip(policy.checks, outcome.results)]
    verdict, code = combine(results, policy.on_inconclusive)
    return GateOutcome(verdict, results, code, rule(policy.on_inconclusive))


def _relative_speed(cfg: Any) -> bool:
    return isinstance(cfg, PerformanceCheckConfig) and (cfg.min_ratio is not None or cfg.max_ratio is not None)


def _log_ratios(cfg: PerformanceCheckConfig, run: dict[str, Evidence]) -> np.ndarray:
    """One run's paired log-ratios, candidate over baseline, over the pairs its contention guard keeps."""
    cand, base = run["candidate"].repeats, run["baseline"].repeats
    c, b = (np.asarray(arm.get(cfg.metric, []), dtype=float) for arm in (cand, base))
    n = min(len(c), len(b))
    steady = None if cfg.metric.startswith(LOAD_PREFIX) else steady_pairs(cfg, cand, base, n)
    keep = steady[0] if steady else np.ones(n, dtype=bool)
    return np.log(c[:n][keep] / b[:n][keep])


def _unpaired(policy: Any, cfg: PerformanceCheckConfig, run_b: dict[str, Evidence], run_a: dict[str, Evidence],
              same_baseline: bool) -> CheckResult:
    check = CHECKS.create(cfg, confidence=policy.confidence)
    why = ("RUN_B's and RUN_A's candidates were measured in different runs, each paired with its own baseline "
           "under that run's load, never with each other. To judge their speeds, measure them in one run: a "
           "recipe with both as candidates, or with RUN_A's as the baseline")
    b, a = _log_ratios(cfg, run_b), _log_ratios(cfg, run_a)
    if not same_baseline or len(b) < 2 or len(a) < 2:
        return check.too_little(f"not judged: {why}", observed=None, baseline=None, threshold=check.threshold())
    from scipy import stats

    interval = stats.ttest_ind(b, a, equal_var=False).confidence_interval(check.confidence)  # Welch's
    ratio, lo, hi = (math.exp(v) for v in (b.mean() - a.mean(), interval.low, interval.high))
    return check.too_little(f"B over A through the shared baseline {ratio:.3g} [{lo:.3g}, {hi:.3g}] at "
                            f"{percent(check.confidence)}, a figure, not judged: {why}",
                            observed=ratio, baseline=1.0, threshold=check.threshold(), ci=(lo, hi),
                            method=f"Welch t-interval on the two runs' paired log-ratios ({len(b)} and {len(a)} pairs)")
