"""The search: every candidate serving configuration judged against one baseline, one winner.

Picking the best of N candidates, each tested at level alpha, lets a bad one through far more
often than alpha: with five candidates all sitting exactly at a quality margin, each passes
about alpha of the time, and the search promotes one whenever any passes. The search therefore
judges every candidate at the family's confidence (Bonferroni: each check's error rate divided
by the number of candidates judged), so the chance that it promotes any candidate that is really
worse than a margin stays at most the single-candidate rate. The winner's speed is the maximum
of N noisy measurements, biased upward; it is measured again, fresh, before the verdict.
"""

from __future__ import annotations

from kiln.pipeline.gate.policy import GateSection


def family_confidence(confidence: float, candidates: int) -> float:
    """The confidence each of `candidates` must be judged at for the family to keep `confidence`:
    the error rate 1 - confidence shared equally (Bonferroni)."""
    if candidates < 1:
        raise ValueError(f"a search judges at least one candidate, not {candidates}")
    return 1 - (1 - confidence) / candidates


def for_family(policy: GateSection, candidates: int) -> GateSection:
    """`policy` with the gate's and every check's own confidence corrected for `candidates` judged."""
    checks = [c.model_copy(update={"confidence": family_confidence(c.confidence, candidates)})
              if c.confidence is not None else c for c in policy.checks]
    return policy.model_copy(update={"confidence": family_confidence(policy.confidence, candidates),
                                     "checks": checks})
