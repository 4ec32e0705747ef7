"""Lossless check: a lever that claims lossless output (speculative decoding) changes no greedy token.

The candidate's answers (every benchmark prompt, every served-text prompt) are compared with its
plain twin's: the same engine folder, loaded without the lever (`EngineConfig.plain_twin`), greedy,
token for token (kiln.evaluate.quality.lossless records them). Where the two split, the twin's
log-prob gap between its token and the candidate's must be within the near-tie tolerance that every
engine's parity check shares (kiln.evaluate.parity.TIE_TOLERANCE); beyond it the text changed.

There is no interval: one real change is a defect, not a rate to bound, so the check is Failed on
any and Successful on none. A candidate with no such lever (no plain twin) is shown as not
applicable: Successful, no observed value, its method and reason saying so. A candidate whose
stage recorded nothing is Inconclusive on too little data (it blocks).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.metrics import declare

MATCH = "lossless_match"  # per answer: 1.0 when it equals the twin's up to near-ties, else 0.0
APPLIES = "lossless_applies"  # the stage's metric: 1.0 when the candidate has a plain twin, 0.0 when not
DIVERGENCE = "lossless_divergence"  # per answer: where and how it split from the twin's ("" where it did not)
NEAR_TIES = "lossless_near_ties"  # the stage's metric: answers that split from the twin's only at a near-tie
NOT_APPLICABLE = "not applicable"
LINE = "- {kind: lossless}"  # what a recipe adds under gate.checks

declare(MATCH, True, "fraction", "answers (benchmark and served-text prompts) whose greedy tokens equal the plain "
        "twin's (the same engine without speculation), a split at a near-tie allowed", "lossless",
        "evaluate.benchmark")


class LosslessCheckConfig(CheckConfig):
    reads: ClassVar[str] = "lossless"
    kind: Literal["lossless"] = "lossless"
    metric: Literal["lossless_match"] = MATCH


@CHECKS.register("lossless", LosslessCheckConfig)
class LosslessCheck(Check):
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        threshold = "identical to the plain twin (near-ties allowed)"
        applies = candidate.metrics.get(APPLIES)
        if applies is None:
            return self.too_little("no lossless stage recorded the candidate's answers against its plain twin",
                                   observed=None, baseline=None, threshold=threshold)
        if not applies:
            return self.result(Verdict.SUCCESSFUL, observed=None, baseline=None, threshold=threshold,
                               method=NOT_APPLICABLE, reason=f"{NOT_APPLICABLE}: the candidate's engine has no "
                               "lever that claims lossless output (no speculative decoding), so nothing to compare")
        matches = candidate.samples.get(MATCH, {})
        if not matches:
            return self.too_little("the lossless stage recorded no answers", observed=None, baseline=None,
                                   threshold=threshold)
        ids = sorted(matches, key=_natural)
        changed = [i for i in ids if not matches[i]]
        n, ties = len(ids), int(candidate.metrics.get(NEAR_TIES, 0))
        fields = dict(observed=(n - len(changed)) / n, baseline=1.0, threshold=threshold,
                      method=f"greedy tokens against the plain twin's on {n} answers, near-tie rule")
        if changed:
            first = candidate.samples.get(DIVERGENCE, {}).get(changed[0]) or changed[0]
            return self.result(Verdict.FAILED, reason=f"{len(changed)} of {n} answers changed from the plain twin's: "
                               f"{first}" + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""), **fields)
        tied = f", {ties} split from it only at a near-tie" if ties else ""
        return self.result(Verdict.SUCCESSFUL, reason=f"all {n} answers equal the plain twin's{tied}", **fields)


def _natural(doc_id: str) -> tuple[Any, ...]:
    """'benchmark 10' after 'benchmark 9'."""
    head, _, tail = doc_id.rpartition(" ")
    return (head, int(tail)) if tail.isdigit() else (doc_id, -1)


def unguarded(engines: Iterable[tuple[str, Any]], checks: Iterable[CheckConfig]) -> str | None:
    """Why a recipe cannot be judged so: an engine (where, config) whose output is claimed lossless (it
    has a plain twin) under a gate without a lossless check; None when every such engine is checked."""
    if any(c.kind == "lossless" for c in checks):
        return None
    claimed = [where for where, config in engines if config is not None and config.plain_twin() is not None]
    if not claimed:
        return None
    return (f"{', '.join(claimed)}: speculative decoding claims the same greedy text as the engine without it, and "
            f"gate.checks has no check that holds it to that: add `{LINE}` to gate.checks (every benchmark and "
            "served-text answer compared with the plain engine's, token for token)")
