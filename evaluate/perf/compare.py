"""Candidate-over-baseline ratios with intervals across interleaved repeats, never one number.

Each repeat runs the baseline and the candidate back to back under the same workload, so slow
drift of a shared machine hits both arms of a pair alike. The ratio of a pair is candidate /
baseline; across repeats we take the mean of log ratios and a Student-t interval on it
(exponentiated: a geometric-mean ratio with a 95% interval). With one repeat there is no
interval, and the comparison says so rather than inventing one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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
