"""Quality checks on paired per-sample results: non-inferiority with a margin.

Baseline and candidate are joined on doc id. Accuracy-like 0/1 items use an exact McNemar test;
perplexity the per-document log-ratios (the widest of a t, a skew-corrected t and a bootstrap-t
interval, and no pass on fewer than `min_perplexity_documents(confidence)` documents); other
continuous items a seeded paired bootstrap. A check passes only when the confidence bound on the
drop is inside the margin (kiln.core.stats.non_inferiority).

Two undecided checks had too little data rather than a wide interval, and block whatever
`on_inconclusive` says (`insufficient`): perplexity on fewer documents than its minimum, and a check
whose items are too few to pass even if the candidate matched the baseline on every one (10 0/1
items leave McNemar's interval about ±0.3 at best: no margin of 0.03 can be shown on them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.gate.performance import bounded_verdict
from kiln.core.metrics import metric

BOOTSTRAP_ITERATIONS = 10_000
SEED = 0
# Fewer perplexity documents than this cannot pass: with most documents a little worse and a few
# much worse, a small sample often holds none of the bad few, and then every interval (t,
# bootstrap-t, BCa, percentile) is short and passes a candidate sitting on the margin far more
# often than the 2.5% a 95% interval claims. bench/ppl_calibration.py measures it; docs/quality.md.
MIN_PERPLEXITY_DOCUMENTS = 24
# The damage the minimum is sized for: one document in DAMAGED_SHARE much worse (the calibration's
# "skewed" shape). A sample misses all of them with probability (1 - share)^n whatever the interval;
# the minimum keeps that chance within MISSED_SHARE of the one-sided error rate, the rest of the
# rate left to samples that hold one or two of them (which the skew-corrected end nearly always
# fails: bench/selection_sim.py, docs/quality.md).
DAMAGED_SHARE, MISSED_SHARE = 0.2, 2 / 3


def min_perplexity_documents(confidence: float) -> int:
    """The fewest documents a perplexity check at `confidence` (two-sided) may pass on: at least
    MIN_PERPLEXITY_DOCUMENTS, and enough that a sample misses every document of a damage confined
    to one in five with probability at most MISSED_SHARE of (1 - confidence) / 2. 24 up to 98.33%
    (the 95% gate shared by three candidates), 26 at 99% (five), 29 at 99.5% (ten)."""
    one_sided = (1 - confidence) / 2
    seen = math.ceil(math.log(MISSED_SHARE * one_sided) / math.log(1 - DAMAGED_SHARE) - 1e-9)
    return max(MIN_PERPLEXITY_DOCUMENTS, seen)


class QualityCheckConfig(CheckConfig):
    reads: ClassVar[str] = "quality"
    kind: Literal["quality"] = "quality"
    margin: float = Field(ge=0, description="largest tolerated drop (in the metric's units, or a fraction if relative)")
    relative: bool = Field(False, description="margin is a fraction of the baseline (perplexity: 0.05 = +5%)")


def joined(candidate: Evidence, baseline: Evidence, key: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    c, b = candidate.samples.get(key, {}), baseline.samples.get(key, {})
    ids = sorted(set(c) & set(b), key=lambda s: (len(s), s))
    if not ids:
        raise ValueError(f"no per-sample '{key}' records shared by baseline and candidate")
    if len(ids) != len(c) or len(ids) != len(b):
        raise ValueError(f"'{key}' records differ: {len(b)} baseline, {len(c)} candidate, {len(ids)} shared doc ids")
    return ids, np.array([b[i] for i in ids], dtype=float), np.array([c[i] for i in ids], dtype=float)


def compare(name: str, candidate: Evidence, baseline: Evidence, confidence: float, relative: bool = False) -> Any:
    """`kiln.core.stats.Comparison` of one quality metric, paired on doc id: perplexity from
    per-document NLL and token counts (`stats.paired_log_ratio`), 0/1 items by exact McNemar, other
    scores by bootstrap."""
    from kiln.core import stats

    if name == "perplexity":
        _, b_nll, c_nll = joined(candidate, baseline, "nll")
        _, tokens, _ = joined(candidate, baseline, "tokens")
        return stats.paired_log_ratio(b_nll, c_nll, tokens, relative=relative, confidence=confidence,
                                      iterations=BOOTSTRAP_ITERATIONS, seed=SEED, metric="perplexity")
    _, b, cand = joined(candidate, baseline, name)
    if not relative and set(np.unique(np.concatenate([b, cand]))) <= {0.0, 1.0}:
        return stats.mcnemar_exact(b.astype(bool), cand.astype(bool), confidence, metric=name)
    return stats.paired_bootstrap(b, cand, relative=relative, confidence=confidence,
                                  iterations=BOOTSTRAP_ITERATIONS, seed=SEED, metric=name)


def too_few_documents(ni: Any, n: int, least: int) -> Any:
    """A perplexity pass (or undecided interval) on fewer than `least` documents
    (`min_perplexity_documents`), turned Inconclusive on too little data: the interval's upper end is
    not trusted there. A Failed verdict stands (its lower end is), and so does a pass on identical
    records (the same computation on every document: nothing to skew)."""
    needed = max(least, ni.items_needed or 0)
    reason = (f"{n} documents are too few to pass at this confidence: below {least} a sample too often misses "
              f"the few documents a candidate damages most, and the interval then passes a regression "
              f"(bench/ppl_calibration.py); about {needed} items would decide it. {ni.reason}")
    return dataclasses.replace(ni, verdict=Verdict.INCONCLUSIVE, reason=reason, items_needed=needed)


def paired_metrics(candidate: Evidence, baseline: Evidence) -> list[str]:
    """Quality metrics both arms kept per-item records of (perplexity from per-document NLL)."""
    shared = set(candidate.samples) & set(baseline.samples)
    return (["perplexity"] if {"nll", "tokens"} <= shared else []) + sorted(shared - {"nll", "tokens"})


@CHECKS.register("quality", QualityCheckConfig)
class QualityCheck(Check):
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        from kiln.core import stats

        c: QualityCheckConfig = self.config  # type: ignore[assignment]
        m = metric(c.metric, f"gate check {c.label}")
        cmp = compare(c.metric, candidate, baseline, self.confidence, c.relative)
        ni = stats.non_inferiority(cmp, c.margin, m.higher_is_better)
        least = min_perplexity_documents(self.confidence)
        short = False  # too little data: blocks whatever on_inconclusive says
        if c.metric == "perplexity" and cmp.n < least and ni.verdict in (Verdict.SUCCESSFUL, Verdict.INCONCLUSIVE):
            identical = cmp.extra["log_ratio"] == 0 and cmp.extra["log_ratio_se"] == 0  # the same NLL on every document
            ni, short = (ni, False) if identical else (too_few_documents(ni, cmp.n, least), True)
        elif c.metric != "perplexity" and ni.verdict is Verdict.INCONCLUSIVE:
            ni, short = _too_few_to_pass(c, m.higher_is_better, baseline, cmp.n, ni, self.confidence)
        margin = f"{100 * c.margin:g}% (relative)" if c.relative else f"{c.margin:g}"  # as its interval is shown
        fields = dict(observed=cmp.candidate, baseline=cmp.baseline, threshold=f"drop ≤ {margin}",
                      ci=(cmp.ci_low, cmp.ci_high), drop=ni.drop, drop_ci=ni.interval, p_value=cmp.p_value,
                      method=cmp.method, items_needed=ni.items_needed)
        return self.too_little(ni.reason, **fields) if short else self.result(ni.verdict, reason=ni.reason, **fields)


def _too_few_to_pass(c: QualityCheckConfig, higher_is_better: bool, baseline: Evidence, n: int, ni: Any,
                     confidence: float) -> tuple[Any, bool]:
    """(ni, whether its items were too few): too few when a candidate that matched the baseline on
    every item would be undecided too, so no outcome of these `n` items could pass. The reason
    names how many items that best case needs; items_needed stays the observed difference's
    estimate (its reason's "about N items"), or the best case's when there is none."""
    from kiln.core import stats

    best = stats.non_inferiority(compare(c.metric, baseline, baseline, confidence, c.relative), c.margin,
                                 higher_is_better)
    if best.verdict is not Verdict.INCONCLUSIVE:
        return ni, False
    need = f"at least {best.items_needed}" if best.items_needed else "more"
    why = (f"{n} paired items cannot show a drop within {c.margin:g} at this confidence even if the candidate "
           f"matched the baseline on every one ({need} would). {ni.reason}")
    return dataclasses.replace(ni, reason=why, items_needed=ni.items_needed or best.items_needed), True


class AgreementCheckConfig(CheckConfig):
    reads: ClassVar[str] = "quality"
    kind: Literal["agreement"] = "agreement"
    min: float | None = Field(None, description="lower bound (top1_agreement, greedy_match)")
    max: float | None = Field(None, description="upper bound (kl_mean, kl_p99)")

    @model_validator(mode="after")
    def _one_bound(self) -> AgreementCheckConfig:
        if (self.min is None) == (self.max is None):
            raise ValueError("set exactly one of min, max")
        return self


@CHECKS.register("agreement", AgreementCheckConfig)
class AgreementCheck(Check):
    """Candidate-vs-baseline token agreement against an absolute bound, with a bootstrap interval
    over documents (the baseline agrees with itself perfectly, so there is nothing to pair)."""

    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        from scipy import stats as sps

        c: AgreementCheckConfig = self.config  # type: ignore[assignment]
        metric(c.metric, f"gate check {c.label}")
        values = np.array(list(candidate.samples.get(c.metric, {}).values()), dtype=float)
        if len(values) < 2:
            raise ValueError(f"need per-document '{c.metric}' values for at least 2 documents, got {len(values)}")
        mean = float(values.mean())
        if np.ptp(values) == 0:
            lo = hi = mean
        else:
            ci = sps.bootstrap((values,), np.mean, confidence_level=self.confidence, n_resamples=BOOTSTRAP_ITERATIONS,
                               rng=np.random.default_rng(SEED), method="BCa").confidence_interval
            lo, hi = float(ci.low), float(ci.high)
        verdict = bounded_verdict(lo, hi, c.min, c.max)
        bound = f"≥ {c.min:g}" if c.min is not None else f"≤ {c.max:g}"
        return self.result(verdict, observed=mean, baseline=None, threshold=bound, ci=(lo, hi),
                           method=f"BCa bootstrap over {len(values)} documents",
                           reason=f"{c.metric} {mean:.4g} [{lo:.4g}, {hi:.4g}]")


