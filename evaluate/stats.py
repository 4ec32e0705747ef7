"""Paired statistics for comparing a candidate model with its baseline, item by item.

kiln joins candidate and baseline per-sample results on doc_id, so both arms saw the same items
and every test here is paired: item difficulty cancels out, which is why a paired test sees a
regression that an unpaired one (lm-eval's comparison script) misses on the same data.
`unpaired_test` exists only to show that in the tests.

A gate check is non-inferiority with a margin: pass only when the whole confidence interval says
the candidate is at most `margin` worse. Everything returns plain dataclasses whose `to_dict()`
is JSON-ready; thresholds and policy belong to the gate, not here.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import optimize, stats

from kiln.pipeline.errors import BadInput
from kiln.pipeline.verdict import Verdict


def jsonable(obj: Any) -> Any:
    """numpy scalars and enums -> built-in types, so json.dumps never needs a default."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Candidate vs baseline on one metric. `difference` is candidate - baseline, or
    candidate / baseline - 1 when `relative`; [ci_low, ci_high] is its confidence interval and
    `p_value` tests difference == 0."""

    metric: str
    baseline: float
    candidate: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    method: str
    confidence: float
    relative: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


def _paired(base: Any, cand: Any, dtype: type, least: int) -> tuple[np.ndarray, np.ndarray]:
    base, cand = np.asarray(base), np.asarray(cand)
    if base.ndim != 1 or base.shape != cand.shape:
        raise BadInput(
            f"base and cand must be 1-D and the same length (one entry per doc_id, joined): "
            f"got shapes {base.shape} and {cand.shape}. Join the per-sample results on doc_id first."
        )
    if base.size < least:
        raise BadInput(f"base/cand: need at least {least} paired items, got {base.size}.")
    if dtype is bool:
        for name, a in (("base", base), ("cand", cand)):
            if a.dtype != bool and not np.isin(a, (0, 1)).all():
                raise BadInput(f"{name}: McNemar needs 0/1 (correct/incorrect) outcomes per item.")
        return base.astype(bool), cand.astype(bool)
    base, cand = base.astype(float), cand.astype(float)
    if not (np.isfinite(base).all() and np.isfinite(cand).all()):
        raise BadInput("base/cand: per-item values must be finite (found NaN or inf); drop or fix those items.")
    return base, cand


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise BadInput(f"confidence must be between 0 and 1 (e.g. 0.95), got {confidence}.")
    return float(stats.norm.ppf(0.5 + confidence / 2))


def _tango_score(delta: float, won: int, lost: int, n: int) -> float:
    """Tango's score statistic for H0: (won - lost) / n == delta, with the probability of a
    lost item replaced by its maximum-likelihood value under H0 (a closed-form quadratic root)."""
    b = -won - lost + (2 * n - won + lost) * delta
    c = -lost * delta * (1 - delta)
    p_lost = (math.sqrt(max(b * b - 8 * n * c, 0.0)) - b) / (4 * n)
    var = n * (2 * p_lost + delta * (1 - delta))
    return (won - lost - n * delta) / math.sqrt(max(var, 1e-300))


def tango_interval(won: int, lost: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Tango (1998) asymptotic score interval for a paired difference of proportions: the deltas
    whose score test does not reject. Recommended for paired binary data by Fagerland, Lydersen
    and Laake (2013); with no discordant items it is a narrow interval around 0 whose width
    shrinks like 1/n, never a false [0, 0]."""
    z, est = _z(confidence), (won - lost) / n

    def f(d: float, target: float) -> float:
        return _tango_score(d, won, lost, n) - target

    low = -1.0 if f(-1.0, z) <= 0 else optimize.brentq(f, -1.0, est, args=(z,), xtol=1e-12)
    high = 1.0 if f(1.0, -z) >= 0 else optimize.brentq(f, est, 1.0, args=(-z,), xtol=1e-12)
    return low, high


def mcnemar_exact(base: Any, cand: Any, confidence: float = 0.95, metric: str = "accuracy") -> Comparison:
    """Paired 0/1 outcomes (correct per item). p-value: exact McNemar, a two-sided binomial test
    of the discordant items (lost vs won) against 1/2; 1.0 when there are none. CI of the accuracy
    difference: Tango's score interval (`tango_interval`). The two can disagree at the edge (p just
    under 0.05 with 0 inside the CI); the gate uses the CI."""
    base, cand = _paired(base, cand, bool, 1)
    n = base.size
    lost, won = int(np.sum(base & ~cand)), int(np.sum(~base & cand))
    p = 1.0 if won + lost == 0 else float(stats.binomtest(min(won, lost), won + lost, 0.5).pvalue)
    low, high = tango_interval(won, lost, n, confidence)
    return Comparison(metric, float(base.mean()), float(cand.mean()), (won - lost) / n, low, high,
                      min(p, 1.0), n, "mcnemar-exact+tango-score", confidence,
                      extra={"won": won, "lost": lost})


Statistic = Callable[..., np.ndarray]


def _expanded_alpha(alpha: float, n: int) -> float:
    """Hesterberg's expanded percentile bootstrap: widen the levels by the t vs normal gap, so
    small sets are not made to look certain (the plain percentile interval under-covers there)."""
    return 2 * stats.norm.sf(math.sqrt(n / (n - 1)) * stats.t.ppf(1 - alpha / 2, n - 1))


def _nominal_alpha(adjusted: float, n: int) -> float:
    """Inverse of `_expanded_alpha`: turns the bootstrap's own p-value into one on the nominal scale."""
    if adjusted >= 1:
        return 1.0
    return float(2 * stats.t.sf(stats.norm.isf(adjusted / 2) / math.sqrt(n / (n - 1)), n - 1))


def _check_bootstrap(base: np.ndarray, denom: Any, statistic: Any, confidence: float,
                     iterations: int) -> np.ndarray | None:
    _z(confidence)
    w = None if denom is None else np.asarray(denom, dtype=float)
    if w is not None and (w.shape != base.shape or not (w > 0).all()):
        raise BadInput("denom: needs one positive weight per item (e.g. its token count), as long as base/cand.")
    if isinstance(statistic, str) and statistic != "mean":
        raise BadInput(f"statistic must be 'mean' or a numpy-style reduction such as np.median, got {statistic!r}.")
    if statistic != "mean" and denom is not None:
        raise BadInput("denom applies only to statistic='mean' (ratio of sums); drop one of them.")
    if iterations < 100:
        raise BadInput(f"iterations must be >= 100 for a usable interval, got {iterations}.")
    return w


def paired_bootstrap(base: Any, cand: Any, *, denom: Any = None, statistic: str | Statistic = "mean",
                     transform: Callable[[np.ndarray], np.ndarray] | None = None, relative: bool = False,
                     confidence: float = 0.95, iterations: int = 10_000, seed: int = 0,
                     metric: str = "mean") -> Comparison:
    """Paired bootstrap: items are resampled jointly, so each draw keeps every pair together.

    The statistic of one arm is `transform(sum(x) / sum(denom))` ("mean"; denom defaults to ones),
    or `transform(statistic(x, axis=-1))` for a numpy-style reduction such as np.median.
    Perplexity from per-document NLL sums and token counts:
    `paired_bootstrap(base_nll, cand_nll, denom=tokens, transform=np.exp, relative=True)` gives
    difference = ppl ratio - 1 = exp((sum cand - sum base) / sum tokens) - 1.

    CI: expanded percentile interval (`_expanded_alpha`). p-value: the nominal level at which
    that interval would just reach 0. Identical arms give [0, 0] and p = 1.
    """
    base, cand = _paired(base, cand, float, 2)
    n, alpha = base.size, 1 - confidence
    w = _check_bootstrap(base, denom, statistic, confidence, iterations)
    fn = transform or (lambda v: v)

    def stat(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if statistic == "mean":
            return fn(x[idx].sum(axis=-1) / (idx.shape[-1] if w is None else w[idx].sum(axis=-1)))
        return fn(statistic(x[idx], axis=-1))

    def diff(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b, c = stat(base, idx), stat(cand, idx)
        return b, c, (c / b - 1 if relative else c - b)

    b0, c0, d0 = (float(v[0]) for v in diff(np.arange(n)[None, :]))
    rng = np.random.default_rng(seed)
    chunk = max(1, (1 << 21) // n)  # ~16 MB of indices per chunk
    draws = np.concatenate([diff(rng.integers(0, n, size=(min(chunk, iterations - i), n), dtype=np.int32))[2]
                            for i in range(0, iterations, chunk)])
    a = _expanded_alpha(alpha, n)
    low, high = np.quantile(draws, [a / 2, 1 - a / 2])
    tail = min(np.sum(draws <= 0), np.sum(draws >= 0))
    p = _nominal_alpha(min(1.0, 2 * (tail + 1) / (iterations + 1)), n)
    name = statistic if isinstance(statistic, str) else getattr(statistic, "__name__", "custom")
    return Comparison(metric, b0, c0, d0, float(low), float(high), p, n,
                      f"paired-bootstrap({iterations}, seed={seed}, {name}, expanded-percentile)",
                      confidence, relative)


def unpaired_test(base: Any, cand: Any, confidence: float = 0.95, metric: str = "mean") -> Comparison:
    """Two independent samples: two-proportion z test for bool arrays, Welch's t test otherwise.
    Wrong for kiln's joined data (it ignores the pairing); kept to show what pairing buys."""
    base, cand, z = np.asarray(base), np.asarray(cand), _z(confidence)
    if base.dtype == bool and cand.dtype == bool:
        p1, p2, n1, n2 = base.mean(), cand.mean(), base.size, cand.size
        pool = (base.sum() + cand.sum()) / (n1 + n2)
        se0 = math.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
        p = 1.0 if se0 == 0 else float(2 * stats.norm.sf(abs(p2 - p1) / se0))
        se = math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
        low, high, method = p2 - p1 - z * se, p2 - p1 + z * se, "two-proportion-z"
    else:
        res = stats.ttest_ind(cand.astype(float), base.astype(float), equal_var=False)
        p, (low, high), method = float(res.pvalue), res.confidence_interval(confidence), "welch-t"
    return Comparison(metric, float(base.mean()), float(cand.mean()), float(cand.mean() - base.mean()),
                      float(low), float(high), p, int(min(base.size, cand.size)), method, confidence)


@dataclasses.dataclass(frozen=True)
class NonInferiority:
    """A non-inferiority decision. `drop` is how much worse the candidate is (positive = worse) and
    `interval` its CI (low, high), in the margin's units; `bound` is the end of that CI the verdict
    rests on; `items_needed` (Inconclusive only) estimates how many paired items would decide it."""

    verdict: Verdict
    drop: float
    interval: tuple[float, float]
    bound: float
    margin: float
    reason: str
    items_needed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


def non_inferiority(cmp: Comparison, margin: float, higher_is_better: bool) -> NonInferiority:
    """Successful when the worst-case end of the drop's CI is within `margin`, Failed when even the
    best-case end is beyond it, Inconclusive otherwise: a small set cannot pass by noise.

    drop = baseline - candidate when higher is better, candidate - baseline when lower is better
    (fractions of the baseline when `cmp.relative`; `margin` is in the same units, >= 0). With a
    two-sided 95% CI each wrong call (pass a real regression, fail a non-inferior candidate) has
    probability at most 2.5%.

    items_needed: the CI half-width on the side facing the margin scales as 1/sqrt(n); assuming the
    observed difference and per-item spread stay put, it reaches the distance to the margin at
    n * (half_width / distance)^2 items. A planning estimate, not a promise.
    """
    if not margin >= 0:
        raise BadInput(f"margin must be >= 0 (the largest tolerated drop), got {margin}.")
    sign = -1.0 if higher_is_better else 1.0
    drop = sign * cmp.difference + 0.0
    low, high = sorted((sign * cmp.ci_low + 0.0, sign * cmp.ci_high + 0.0))  # + 0.0: no -0.0
    ci = f"{cmp.confidence:.0%} CI of the drop [{low:.4g}, {high:.4g}] ({cmp.method}, n={cmp.n})"
    if not all(map(math.isfinite, (drop, low, high))):
        return NonInferiority(Verdict.ERROR, drop, (low, high), high, margin, f"non-finite statistics: {ci}")
    if high <= margin:
        return NonInferiority(Verdict.SUCCESSFUL, drop, (low, high), high, margin,
                              f"worst case drop {high:.4g} is within margin {margin:.4g}: {ci}")
    if low > margin:
        return NonInferiority(Verdict.FAILED, drop, (low, high), low, margin,
                              f"even the best case drop {low:.4g} exceeds margin {margin:.4g}: {ci}")
    distance = abs(margin - drop)
    half = high - drop if drop < margin else drop - low
    needed = math.ceil(cmp.n * (half / distance) ** 2) if distance > 0 else None
    hint = (f"about {needed} items would decide it" if needed
            else "the observed drop sits on the margin; more items decide it only if it moves")
    return NonInferiority(Verdict.INCONCLUSIVE, drop, (low, high), high, margin,
                          f"margin {margin:.4g} lies inside the {ci}; {hint}", needed)
