"""Always-valid sequential comparison of canary vs stable, for the canary controller.

The controller looks at live per-request values (TTFT in ms, 0/1 errors) after every window and
may stop at any look. A fixed-sample test checked at every look rolls back healthy canaries far
more often than its alpha says; this test stays within alpha however often it is read.

Method: a confidence sequence from Robbins' normal-mixture boundary, the boundary behind the mSPRT
of Johari et al. ("Always valid inference", 2017/2022), applied to the difference of two
independent streams. Each update that has data in both arms is one batch with contrast
d_k = mean(canary_k) - mean(stable_k) and variance v_k = s_c^2/n_ck + s_s^2/n_sk. With
S = sum (d_k - delta)/v_k and V = sum 1/v_k, S is a Gaussian martingale in V, and mixing its
likelihood ratio over an effect delta ~ N(0, effect_scale^2) gives, by Ville's inequality,

    P(exists k: |delta_hat_k - delta| > sqrt((V+rho)(2 log(1/alpha) + log(1 + V/rho))) / V) <= alpha,

rho = 1/effect_scale^2. Contrasts are taken within a batch, so load drifting over time hits both
arms alike, and the canary share may change between batches (setWeight steps). The variances are
plug-in estimates from all data so far, which makes the guarantee asymptotic (Waudby-Smith et al.,
"Time-uniform central limit theory", 2023): exact for Gaussian data with known variance, close
otherwise; tests/deploy/test_sequential.py measures it on lognormal TTFTs.

relative=True compares the means of log values: the geometric-mean ratio canary/stable, which for
lognormal latency is the ratio of medians. It is not the ratio of arithmetic means: a regression in
the tail alone moves it less. binary=True is for 0/1 outcomes and uses a smoothed Bernoulli
variance, so a run of zero errors in both arms is not read as certainty. bounded=True is for
values in [-1, 1] (paired agreement differences): the plug-in variance is at least that of one
unit difference in n + 2 observations, the same smoothing, so a run of identical answers is not
read as certainty either.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import stats

from kiln.core.stats import Verdict, jsonable
from kiln.core.errors import BadInput


@dataclasses.dataclass(frozen=True)
class SequentialDecision:
    """estimate / cs_*: canary - stable, or canary/stable - 1 (geometric means) when relative.
    n_*: observations the interval rests on (an arm's data waits until the other arm has some)."""

    verdict: Verdict
    estimate: float
    cs_low: float
    cs_high: float
    n_stable: int
    n_canary: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return jsonable(dataclasses.asdict(self))


class SequentialTest:
    """Failed when the confidence sequence shows the canary worse than stable by more than
    `margin`, Successful when it shows it within `margin`, Inconclusive otherwise. The chance of
    any wrong verdict over the whole canary is at most `alpha` (asymptotically, see module doc).

    margin: largest tolerated drop, in metric units, or as a fraction when relative (0.10: TTFT
    at most 10% higher, or throughput at most 10% lower). effect_scale: the size of effect the test
    is tuned to find fastest (same units; defaults to margin). No verdict before `min_per_arm`
    observations in each arm.
    """

    def __init__(self, alpha: float = 0.05, margin: float = 0.0, higher_is_better: bool = False,
                 relative: bool = False, effect_scale: float | None = None, binary: bool = False,
                 min_per_arm: int = 20, bounded: bool = False):
        scale = margin if effect_scale is None else effect_scale
        problems = [msg for bad, msg in [
            (not 0 < alpha < 1, f"alpha must be in (0, 1), got {alpha}"),
            (not 0 <= margin < (1 if relative else math.inf), f"margin must be >= 0 (< 1 when relative), got {margin}"),
            (not scale > 0, "effect_scale must be > 0; set it when margin is 0 (e.g. 0.2 for a 20% regression)"),
            (relative and (binary or bounded), "relative and binary (or bounded) cannot both be set: their values have no log"),
            (min_per_arm < 2, f"min_per_arm must be >= 2, got {min_per_arm}"),
        ] if bad]
        if problems:
            raise BadInput("SequentialTest: invalid settings.", problems)
        self.alpha, self.higher_is_better, self.relative = alpha, higher_is_better, relative
        self.binary, self.bounded, self.min_per_arm = binary, bounded, min_per_arm
        # Work on the log scale when relative: a fraction f becomes log(1 + f) (or -log(1 - f) for
        # a drop in something higher-is-better).
        self._margin = (-math.log1p(-margin) if higher_is_better else math.log1p(margin)) if relative else margin
        self._rho = 1.0 / (math.log1p(scale) if relative else scale) ** 2
        self._arms = {"stable": [0, 0.0, 0.0], "canary": [0, 0.0, 0.0]}  # n, mean, sum of squares
        self._batches: list[tuple[int, int, float]] = []  # n stable, n canary, contrast
        self._pending: dict[str, list[np.ndarray]] = {"stable": [], "canary": []}

    def _clean(self, name: str, values: Any) -> np.ndarray:
        x = np.asarray(values, dtype=float).ravel()
        if not np.isfinite(x).all():
            raise BadInput(f"{name}: values must be finite (found NaN or inf); drop failed measurements.")
        if self.relative and (x <= 0).any():
            raise BadInput(f"{name}: relative=True needs values > 0 (it compares logs).")
        if self.binary and not np.isin(x, (0, 1)).all():
            raise BadInput(f"{name}: binary=True needs 0/1 values per request.")
        if self.bounded and (np.abs(x) > 1).any():
            raise BadInput(f"{name}: bounded=True needs values in [-1, 1].")
        return np.log(x) if self.relative else x

    def update(self, stable_values: Any, canary_values: Any) -> None:
        """Add the observations of one look (window). Either arm may be empty: its partner's data
        is held and joins the next batch that has both."""
        for arm, values in (("stable", stable_values), ("canary", canary_values)):
            x = self._clean(f"{arm}_values", values)
            if x.size:
                self._pending[arm].append(x)
        if not (self._pending["stable"] and self._pending["canary"]):
            return
        counts, means = {}, {}
        for arm, parts in self._pending.items():
            x = np.concatenate(parts)
            counts[arm], means[arm] = x.size, float(x.mean())
            self._merge(self._arms[arm], x.size, means[arm], float(np.sum((x - means[arm]) ** 2)))
        self._batches.append((counts["stable"], counts["canary"], means["canary"] - means["stable"]))
        self._pending = {"stable": [], "canary": []}

    @staticmethod
    def _merge(arm: list, n: int, mean: float, m2: float) -> None:
        """Chan et al.'s parallel update of a running count, mean and sum of squared deviations."""
        total = arm[0] + n
        delta = mean - arm[1]
        arm[2] += m2 + delta * delta * arm[0] * n / total
        arm[1] += delta * n / total
        arm[0] = total

    def _variance(self, arm: str) -> float:
        n, mean, m2 = self._arms[arm]
        if self.binary:
            p = (mean * n + 1) / (n + 2)  # Laplace smoothing: never a zero variance
            return p * (1 - p)
        # Variance over the whole arm (not within batches): drift between batches only widens it.
        floor = (n + 1) / (n + 2) ** 2 if self.bounded else 1e-12  # p(1 - p), p = 1 / (n + 2)
        return max(m2 / (n - 1), floor)

    def decide(self) -> SequentialDecision:
        n_s, n_c = self._arms["stable"][0], self._arms["canary"][0]
        if min(n_s, n_c) < self.min_per_arm:
            return SequentialDecision(Verdict.INCONCLUSIVE, math.nan, -math.inf, math.inf, n_s, n_c,
                                      f"waiting for {self.min_per_arm} observations per arm")
        b = np.array(self._batches)
        weight = 1.0 / (self._variance("stable") / b[:, 0] + self._variance("canary") / b[:, 1])
        info = float(weight.sum())
        est = float(weight @ b[:, 2]) / info
        radius = math.sqrt((info + self._rho) * (2 * math.log(1 / self.alpha) + math.log1p(info / self._rho))) / info
        sign = -1.0 if self.higher_is_better else 1.0
        drop_low, drop_high = sorted((sign * (est - radius), sign * (est + radius)))
        show = math.expm1 if self.relative else float
        low, high = show(est - radius), show(est + radius)
        cs = f"{1 - self.alpha:.0%} confidence sequence [{low:.4g}, {high:.4g}] (n={n_s}/{n_c} stable/canary)"
        if drop_low > self._margin:
            verdict, why = Verdict.FAILED, "canary is worse than stable beyond the margin"
        elif drop_high <= self._margin:
            verdict, why = Verdict.SUCCESSFUL, "canary is within the margin of stable"
        else:
            verdict, why = Verdict.INCONCLUSIVE, "the margin is still inside the interval"
        return SequentialDecision(verdict, show(est), low, high, n_s, n_c, f"{why}: {cs}")


def fixed_horizon_n(effect: float, sd: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Observations per arm for a one-sided two-sample z test at level alpha to detect `effect`
    with the given power (equal arms, known sd): the yardstick the sequential test is compared to."""
    if not (effect > 0 and sd > 0 and 0 < alpha < 1 and 0 < power < 1):
        raise BadInput("fixed_horizon_n: effect and sd must be > 0, alpha and power in (0, 1).")
    z = stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)
    return math.ceil(2 * (z * sd / effect) ** 2)
