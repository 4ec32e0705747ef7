"""The recipe's gate policy, judged on live traffic with always-valid sequential tests.

The offline gate (`kiln run`) judges fixed samples once. The canary controller looks at live data
again and again, and may stop at any look; a fixed-sample interval read at every look would roll
back healthy canaries far more often than its confidence says. So each check the live data can
speak to becomes a `SequentialTest` (deploy/sequential.py: a normal-mixture confidence sequence),
one per check for the whole walk, and the check's verdicts are combined by the same rule as
offline (`kiln.core.gate.policy.combine`).

How each check kind maps (the threshold semantics stay those of the offline check):
- performance, min_ratio / max_ratio on ttft_ms, tpot_ms, decode_tok_s: canary / stable ratio of
  geometric means (relative=True), canary values divided by the bound so the margin is 0; which
  side is bad comes from the bound (max_* = above is bad), as in the offline check.
- performance, min / max (an SLO): canary mean against the constant bound. A two-sample sequence
  against a zero-variance reference arm is exactly the one-sample sequence.
- error_rate, max: canary failures (0/1 per request, binary=True) against a reference of zeros,
  margin = max: "canary error rate at most max". Conservative: the reference's smoothed variance
  adds to the canary's.
- agreement on served_prefix, served_match (or greedy_match, read as served_match) with a min:
  mirrored greedy prompts (router mirror_fraction > 0), each answered by stable twice and by the
  canary once and scored as the offline served-text check scores a pair
  (kiln.evaluate.quality.served.served_scores): canary vs stable, and stable vs stable (the noise
  floor). Paired per prompt: the drop floor - canary against zeros, margin 1 - min, shown as
  1 - drop. Offline the reference is one request at a time, so its floor is 1 and the check reads
  "agreement >= min"; live, nondeterminism that stable shows itself does not count against the
  canary. With a deterministic stable the floor is 1.0, the statistic is the offline one, and the
  check's reason says so.
- quality, size, other metrics: skipped with the reason (judged offline; no live signal).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from kiln.deploy.base import ArmData, Observations
from kiln.deploy.sequential import SequentialDecision, SequentialTest
from kiln.core.errors import BadInput
from kiln.core.gate.base import TOO_LITTLE, CheckConfig, CheckResult
from kiln.core.gate.policy import GateOutcome, GateSection, combine
from kiln.core.units import check_figures

LIVE_SIGNALS: dict[str, Callable[[ArmData], list[float]]] = {
    "ttft_ms": lambda a: a.ttft_ms,
    "tpot_ms": lambda a: a.tpot_ms,
    "decode_tok_s": lambda a: [1000 / t for t in a.tpot_ms if t > 0],
}
# Agreement metrics with a live signal -> the Comparison field that scores them.
MIRRORED = {"served_prefix": "prefix", "served_match": "match", "greedy_match": "match"}
METHOD = "always-valid normal-mixture confidence sequence (Robbins; mSPRT)"


@dataclass
class LiveCheck:
    config: CheckConfig
    test: SequentialTest
    feed: Callable[[Observations], tuple[list[float], list[float]]]  # (reference/stable, canary)
    show: Callable[[float], float]  # decision scale -> the check's own scale
    threshold: str
    note: Callable[[], str] = lambda: ""  # what the reason adds (the agreement checks' noise floor)

    def result(self) -> CheckResult:
        d: SequentialDecision = self.test.decide()
        lo, hi = sorted((self.show(d.cs_low), self.show(d.cs_high)))
        finite = math.isfinite(lo) and math.isfinite(hi)
        observed = None if math.isnan(d.estimate) else self.show(d.estimate)
        why = d.reason.split(":")[0]  # the test's words; its numbers are on the test's own scale
        if finite and observed is not None:  # in the check's unit: 182.5 ms, 1.02x, 0.4%
            shown, _, sequence = check_figures({"kind": self.config.kind, "metric": self.config.metric,
                                                "threshold": self.threshold, "observed": observed, "ci": (lo, hi)})
            why += (f": {shown}, {1 - self.test.alpha:.0%} confidence sequence {sequence}, "
                    f"threshold {self.threshold} (n={d.n_stable}/{d.n_canary} reference/canary)")
        why += self.note()
        short = min(d.n_stable, d.n_canary) < self.test.min_per_arm  # no verdict yet: too few observations
        return CheckResult(name=self.config.label, kind=self.config.kind, metric=self.config.metric,
                           verdict=d.verdict, observed=observed, baseline=None, threshold=self.threshold,
                           ci=(lo, hi) if finite else None, method=f"{METHOD}, n={d.n_stable}/{d.n_canary}",
                           reason=why + (TOO_LITTLE if short else ""), insufficient=short)


class LiveGate:
    """Feed it every window with `update`; `judge()` gives the policy's verdict so far."""

    def __init__(self, policy: GateSection, alpha: float | None = None, min_per_arm: int = 20,
                 effect_scale: float = 0.1, mirroring: bool = False):
        self.policy = policy
        self.checks: list[LiveCheck] = []
        self.skipped: list[dict[str, str]] = []
        for cfg in policy.checks:
            a = alpha if alpha is not None else 1 - (cfg.confidence or policy.confidence)
            live, why = _plan(cfg, a, min_per_arm, effect_scale, mirroring)
            if live is None:
                self.skipped.append({"check": cfg.label, "reason": why})
            else:
                self.checks.append(live)
        if not self.checks:
            raise BadInput("gate.checks: none of the checks can be judged on live traffic.",
                           [f"{s['check']}: {s['reason']}" for s in self.skipped]
                           + ["add an error_rate check, or a performance check on ttft_ms / tpot_ms / decode_tok_s"])

    def update(self, obs: Observations) -> None:
        for check in self.checks:
            reference, canary = check.feed(obs)
            check.test.update(reference, canary)

    def judge(self) -> GateOutcome:
        results = [c.result() for c in self.checks]
        verdict, code = combine(results, "fail")
        return GateOutcome(verdict, results, code, "any Failed fails; live checks are sequential (valid at every look)")


def _plan(cfg: CheckConfig, alpha: float, min_per_arm: int, scale: float,
          mirroring: bool) -> tuple[LiveCheck | None, str]:
    kind = cfg.kind
    if kind == "performance":
        return _performance(cfg, alpha, min_per_arm, scale)
    if kind == "error_rate":
        bound = cfg.max  # type: ignore[attr-defined]
        test = SequentialTest(alpha, margin=bound, binary=True, effect_scale=max(bound, 0.01), min_per_arm=min_per_arm)
        return LiveCheck(cfg, test, lambda o: ([0.0] * o.canary.requests, [float(e) for e in o.canary.errors]),
                         float, f"≤ {bound:g}"), ""
    if kind == "agreement":
        return _agreement(cfg, alpha, min_per_arm, mirroring)
    if kind == "quality":
        return None, "judged offline on the evaluation set (live requests have no reference answers)"
    if kind == "size":
        return None, "a checkpoint's size does not change in production"
    return None, f"no live mapping for check kind '{kind}'"


class MirroredFeed:
    """Paired drops (floor - canary) of one agreement metric, and the floor seen so far."""

    def __init__(self, score: str):
        self.score, self.n, self.floor, self.canary = score, 0, 0.0, 0.0

    def __call__(self, o: Observations) -> tuple[list[float], list[float]]:
        pairs = [(getattr(c, f"floor_{self.score}"), getattr(c, self.score)) for c in o.mirrored]
        self.n += len(pairs)
        self.floor += sum(f for f, _ in pairs)
        self.canary += sum(c for _, c in pairs)
        return [0.0] * len(pairs), [f - c for f, c in pairs]

    def note(self) -> str:
        if not self.n:
            return ""
        floor = self.floor / self.n
        why = ("stable answered every mirrored prompt identically twice (deterministic)" if floor == 1
               else "stable disagrees with itself this much: the canary is judged against that")
        return (f"; canary vs stable {self.canary / self.n:.4g}, noise floor (stable vs stable) "
                f"{floor:.4g} over {self.n} mirrored prompts: {why}")


def _agreement(cfg: CheckConfig, alpha: float, min_per_arm: int, mirroring: bool) -> tuple[LiveCheck | None, str]:
    score = MIRRORED.get(cfg.metric)
    if score is None or getattr(cfg, "min", None) is None:
        return None, (f"only {', '.join(MIRRORED)} with a min have a live signal (mirrored greedy prompts)")
    if not mirroring:
        return None, "needs mirrored requests: set deploy.router.mirror_fraction > 0"
    bound = cfg.min  # type: ignore[attr-defined]
    test = SequentialTest(alpha, margin=1 - bound, bounded=True, effect_scale=max(1 - bound, 0.01),
                          min_per_arm=min_per_arm)
    feed = MirroredFeed(score)
    return LiveCheck(cfg, test, feed, lambda d: 1 - d, f"≥ {bound:g} (1 - drop below the noise floor)",
                     note=feed.note), ""


def _performance(cfg: CheckConfig, alpha: float, min_per_arm: int, scale: float) -> tuple[LiveCheck | None, str]:
    signal = LIVE_SIGNALS.get(cfg.metric)
    if signal is None:
        return None, f"no live per-request signal for metric '{cfg.metric}' (live: {', '.join(LIVE_SIGNALS)})"
    c = cfg
    high_is_bad = c.max_ratio is not None or c.max is not None  # type: ignore[attr-defined]
    ratio = c.min_ratio if c.min_ratio is not None else c.max_ratio  # type: ignore[attr-defined]
    if ratio is not None:
        test = SequentialTest(alpha, margin=0.0, higher_is_better=not high_is_bad, relative=True,
                              effect_scale=scale, min_per_arm=min_per_arm)
        return LiveCheck(cfg, test, lambda o: (signal(o.stable), [v / ratio for v in signal(o.canary)]),
                         lambda d: ratio * (1 + d), f"ratio {'≤' if high_is_bad else '≥'} {ratio:g}"), ""
    bound = c.max if high_is_bad else c.min  # type: ignore[attr-defined]
    test = SequentialTest(alpha, margin=0.0, higher_is_better=not high_is_bad, effect_scale=scale * abs(bound) or scale,
                          min_per_arm=min_per_arm)
    return LiveCheck(cfg, test, lambda o: ([bound] * len(signal(o.canary)), signal(o.canary)),
                     lambda d: bound + d, f"{'≤' if high_is_bad else '≥'} {bound:g}"), ""
