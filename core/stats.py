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

from kiln.core.errors import BadInput
from kiln.core.verdict import Verdict, percent


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


def _bootstrap_t(delta: np.ndarray, tokens: np.ndarray, r: float, iterations: int, seed: int) -> np.ndarray:
    """Studentized draws (R* - R) / se* of the ratio estimate R = sum(delta) / sum(tokens).

    A resample is a vector of counts per document, so every sum it needs is a matrix-vector product
    with a per-document column of e = delta - R t (centred: no cancellation), t, e^2, e t or t^2:
    R* - R = sum* e / sum* t and the resample's residuals are e - (R* - R) t. (Matrix-vector, not
    one matrix product: a threaded BLAS product was 20x slower on a busy 2-core machine.)"""
    n = delta.size
    e = delta - r * tokens
    rng, chunk, out = np.random.default_rng(seed), max(1, (1 << 21) // n), []
    for start in range(0, iterations, chunk):
        m = min(chunk, iterations - start)
        idx = rng.integers(0, n, size=(m, n), dtype=np.int32) + n * np.arange(m, dtype=np.int32)[:, None]
        counts = np.bincount(idx.ravel(), minlength=m * n).reshape(m, n).astype(float)
        s_e, s_t, s_ee, s_et, s_tt = (counts @ col for col in (e, tokens, e * e, e * tokens, tokens * tokens))
        dr = s_e / s_t
        spread = s_ee - 2 * dr * s_et + dr * dr * s_tt
        flat = spread <= 1e-12 * (s_ee + dr * dr * s_tt)  # one document drawn n times: no spread
        se = np.sqrt(np.where(flat, 1.0, spread) * n / (n - 1)) / s_t
        out.append(np.where(flat, np.sign(dr) * 1e300, dr / se))
    return np.concatenate(out)


def _hall_t(t: float, skew: float, n: int) -> float:
    """Hall's (1992) transformation of the studentized mean T = (R - mu) / se, which removes the
    skewness the data's `skew` gives T: g(T) = T + a T^2 + a^2 T^3 / 3 + skew / (6 sqrt n), with
    a = skew / (3 sqrt n). Monotone (g' = (1 + a T)^2), so intervals and tests invert it exactly."""
    a = skew / (3 * math.sqrt(n))
    return t + a * t * t + a * a * t ** 3 / 3 + skew / (6 * math.sqrt(n))


def _hall_inverse(q: float, skew: float, n: int) -> float:
    """The T at which `_hall_t` equals q: ((1 + 3a (q - c))^(1/3) - 1) / a, c = skew / (6 sqrt n)."""
    a, c = skew / (3 * math.sqrt(n)), skew / (6 * math.sqrt(n))
    return q - c if abs(a) < 1e-12 else float((np.cbrt(1 + 3 * a * (q - c)) - 1) / a)


# How many standard errors of the sample skewness Hall's end looks beyond the sample's own (see
# paired_log_ratio): one left Gamma(4) damage at 64 documents passing 2.4% on the margin (t and
# Hall ends, 2 x 40,000 simulated sets), too close to 2.5% to be shown; two leave 2.1%.
SKEWNESS_ALLOWANCE = 2.0


def _skewness_se(n: int) -> float:
    """Standard error of the sample skewness g1 of n normal draws: sqrt(6 (n - 2) / ((n + 1) (n + 3)))."""
    return math.sqrt(6 * (n - 2) / ((n + 1) * (n + 3)))


def paired_log_ratio(base_nll: Any, cand_nll: Any, tokens: Any, *, relative: bool = True, confidence: float = 0.95,
                     iterations: int = 10_000, seed: int = 0, metric: str = "perplexity") -> Comparison:
    """Perplexity candidate vs baseline from per-document NLL sums and token counts.

    The corpus log-ratio R = (sum cand - sum base) / sum tokens is the token-weighted mean of the
    documents' per-token log-ratios, and exp(R) the perplexity ratio. Its interval is the widest,
    at each end, of three intervals on R with the ratio estimator's standard error: Student-t,
    bootstrap-t (documents resampled jointly, the studentized statistic's own quantiles), and
    Hall's skew-corrected t (`_hall_t`). The bootstrap-t end follows skew (most documents a little
    worse, a few much worse: a sample that misses the bad few also has a small spread, and a plain
    t or percentile interval then passes it); the t end keeps heavy symmetric tails covered where
    the bootstrap-t one is too short; the Hall end covers a sample that holds only one or two of
    the bad few, which the bootstrap-t passed too often at the 0.5% per side of a five-candidate
    search (its resamples rarely draw that document more than twice).

    Hall's end takes the skewness facing it SKEWNESS_ALLOWANCE standard errors (`_skewness_se`)
    beyond the sample's skewness g1 of the per-document residuals: g1 + 2 se for the upper end,
    g1 - 2 se for the lower. With the true skewness Hall's end covers continuous right skew
    (Gamma(4), 24 documents: the 2.5% point of T is -2.46, Hall's -2.51), but g1 is low exactly
    where the upper end is missed: a sample whose mean fell short holds few of the large documents,
    so its g1 averaged 0.44 there against 0.74 overall and 1 true, and on g1 itself the check
    passed 3.0% of such samples on the margin. Measured by bench/ppl_calibration.py and
    bench/selection_sim.py through the gate: no interval is trusted below the minimum number of
    documents the gate's quality check sets for its confidence.

    difference: exp(R) - 1 when `relative`, else candidate - baseline perplexity (the interval
    scaled by the baseline's perplexity). p-value: the largest of the three tests of R == 0 (each
    dual to its interval).
    """
    base, cand = _paired(base_nll, cand_nll, float, 2)
    w = _check_bootstrap(base, tokens, "mean", confidence, iterations)
    if w is None:
        raise BadInput("tokens: needs one positive token count per document, as long as base/cand.")
    n, delta = base.size, cand - base
    r = float(delta.sum() / w.sum())
    resid = delta - r * w
    se = math.sqrt(float((resid ** 2).sum()) * n / (n - 1)) / float(w.sum())
    low, high, p, skew = _log_ratio_interval(delta, w, r, resid, se, confidence, iterations, seed)
    b_ppl, c_ppl = math.exp(base.sum() / w.sum()), math.exp(cand.sum() / w.sum())
    scale = 1.0 if relative else b_ppl
    d0, lo, hi = (scale * _expm1(v) for v in (r, low, high))
    return Comparison(metric, b_ppl, c_ppl, d0, lo, hi, p, n,
                      f"paired log-ratio, widest of Student-t, Hall's skew-corrected t and bootstrap-t({iterations}, "
                      f"seed={seed})", confidence, relative, extra={"log_ratio": r, "log_ratio_se": se, "skewness": skew})


def _expm1(v: float) -> float:
    """exp(v) - 1, infinite past float's range: two documents give a Student-t end (1 degree of
    freedom) far beyond it, and the interval then says "unbounded" instead of raising."""
    return math.expm1(v) if v < 709.0 else math.inf


def _log_ratio_interval(delta: np.ndarray, w: np.ndarray, r: float, resid: np.ndarray, se: float, confidence: float,
                        iterations: int, seed: int) -> tuple[float, float, float, float]:
    """(low, high, p-value, skewness) of the corpus log-ratio `r` with standard error `se`: at each
    end the widest of the Student-t, bootstrap-t and Hall intervals; p the largest of their tests
    (see paired_log_ratio)."""
    n, alpha = delta.size, 1 - confidence
    t_q = float(stats.t.ppf(1 - alpha / 2, n - 1))
    if se == 0:  # every document moved by exactly the same amount (identical arms: none at all)
        return r, r, 1.0 if r == 0 else 0.0, 0.0
    u = resid / w.mean()  # each document's share of R - mu, on the per-token scale
    skew = float(np.mean(u ** 3) / np.mean(u ** 2) ** 1.5)
    t_star = _bootstrap_t(delta, w, r, iterations, seed)
    q_low, q_high = np.quantile(t_star, [alpha / 2, 1 - alpha / 2])
    allowance = SKEWNESS_ALLOWANCE * _skewness_se(n)
    skew_high, skew_low = skew + allowance, skew - allowance  # the skewness each end faces
    h_low, h_high = _hall_inverse(-t_q, skew_high, n), _hall_inverse(t_q, skew_low, n)
    low = min(r - t_q * se, r - q_high * se, r - h_high * se)
    high = max(r + t_q * se, r - q_low * se, r - h_low * se)
    t_obs = r / se
    p_boot = 2 * min(np.sum(t_star >= t_obs) + 1, np.sum(t_star <= t_obs) + 1) / (iterations + 1)
    p_hall = 2 * min(stats.t.sf(_hall_t(t_obs, skew_low, n), n - 1), stats.t.cdf(_hall_t(t_obs, skew_high, n), n - 1))
    p = min(1.0, max(p_boot, float(2 * stats.t.sf(abs(t_obs), n - 1)), float(p_hall)))
    return low, high, p, skew


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


def _items_needed(cmp: Comparison, margin: float, sign: float, drop: float,
                  interval: tuple[float, float]) -> int | None:
    """Items at which the interval would clear the margin, the observed difference held fixed.

    McNemar (counts in `cmp.extra`): the Tango interval recomputed with the won/lost counts scaled
    to m items, the smallest m that decides (with no discordant item its half-width shrinks like
    z^2 / m, not 1 / sqrt(m): 10 concordant items and a 0.03 margin need ~125, not ~860). Others:
    the half-width facing the margin scales as 1/sqrt(n), reaching the distance to the margin at
    n * (half_width / distance)^2. None when the observed drop sits on the margin.
    """
    low, high = interval
    if drop == margin:
        return None
    heading_pass = drop < margin
    if "won" not in cmp.extra:
        half = high - drop if heading_pass else drop - low
        return math.ceil(cmp.n * (half / abs(margin - drop)) ** 2)
    won, lost, n = cmp.extra["won"], cmp.extra["lost"], cmp.n

    def decides(m: int) -> bool:
        lo, hi = sorted(sign * v for v in tango_interval(won * m / n, lost * m / n, m, cmp.confidence))
        return hi <= margin if heading_pass else lo > margin

    short, enough = n, 2 * n
    while not decides(enough):
        short, enough = enough, 2 * enough
        if enough > 10**9:
            return None
    while enough - short > 1:
        mid = (short + enough) // 2
        short, enough = (short, mid) if decides(mid) else (mid, enough)
    return enough


def non_inferiority(cmp: Comparison, margin: float, higher_is_better: bool) -> NonInferiority:
    """Successful when the worst-case end of the drop's CI is within `margin`, Failed when even the
    best-case end is beyond it, Inconclusive otherwise: a small set cannot pass by noise.

    drop = baseline - candidate when higher is better, candidate - baseline when lower is better
    (fractions of the baseline when `cmp.relative`; `margin` is in the same units, >= 0). With a
    two-sided 95% CI each wrong call (pass a real regression, fail a non-inferior candidate) has
    probability at most 2.5%.

    items_needed: how many paired items would decide it if the observed difference and spread stayed
    put (`_items_needed`). A planning estimate, not a promise.
    """
    if not margin >= 0:
        raise BadInput(f"margin must be >= 0 (the largest tolerated drop), got {margin}.")
    sign = -1.0 if higher_is_better else 1.0
    drop = sign * cmp.difference + 0.0
    low, high = sorted((sign * cmp.ci_low + 0.0, sign * cmp.ci_high + 0.0))  # + 0.0: no -0.0
    ci = f"{percent(cmp.confidence)} CI of the drop [{low:.4g}, {high:.4g}] ({cmp.method}, n={cmp.n})"
    if not all(map(math.isfinite, (drop, low, high))):
        return NonInferiority(Verdict.ERROR, drop, (low, high), high, margin, f"non-finite statistics: {ci}")
    if high <= margin:
        return NonInferiority(Verdict.SUCCESSFUL, drop, (low, high), high, margin,
                              f"worst case drop {high:.4g} is within margin {margin:.4g}: {ci}")
    if low > margin:
        return NonInferiority(Verdict.FAILED, drop, (low, high), low, margin,
                              f"even the best case drop {low:.4g} exceeds margin {margin:.4g}: {ci}")
    needed = _items_needed(cmp, margin, sign, drop, (low, high))
    hint = (f"about {needed} items would decide it" if needed
            else "the observed drop sits on the margin; more items decide it only if it moves")
    return NonInferiority(Verdict.INCONCLUSIVE, drop, (low, high), high, margin,
                          f"margin {margin:.4g} lies inside the {ci}; {hint}", needed)
