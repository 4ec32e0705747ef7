"""Picking the best of N does not let a bad candidate through more often than one would (issue #18).

Five candidates all sit exactly on the perplexity margin; the search promotes one whenever any
passes every check. Judged at for_family(policy, 5) that happens at most the single-candidate
one-sided 2.5%; bench/selection_sim.py has the full simulation (and the winner's speed bias).
"""

import math

import numpy as np

from kiln.core.gate.base import Evidence, Verdict
from kiln.core.gate.policy import GateSection, judge
from kiln.core.gate.quality import min_perplexity_documents
from kiln.pipeline.stages.phases import family_confidence, for_family

TOKENS, CANDIDATES, MARGIN = 255, 5, 0.05
DOCUMENTS = min_perplexity_documents(family_confidence(0.95, CANDIDATES))  # 26: fewer cannot pass at all
POLICY = GateSection.model_validate({"checks": [
    {"kind": "quality", "metric": "perplexity", "margin": MARGIN, "relative": True}]})


def candidates_on_the_margin(rng):
    def samples(nll):
        return {"nll": {str(i): float(v) for i, v in enumerate(nll)}, "tokens": {str(i): TOKENS for i in range(DOCUMENTS)}}

    base_nll = TOKENS * rng.normal(4.0, 0.3, DOCUMENTS)
    baseline = Evidence("baseline", samples=samples(base_nll))
    for _ in range(CANDIDATES):
        nll = base_nll + TOKENS * (math.log1p(MARGIN) + 0.02 * rng.normal(0, 1, DOCUMENTS))
        yield Evidence("candidate", samples=samples(nll)), baseline


def promoted(gate, arms):
    return any(judge(gate, cand, base).verdict is Verdict.SUCCESSFUL for cand, base in arms)


def test_family_confidence_keeps_the_promotion_rate_of_one_candidate():
    rng, family = np.random.default_rng(7), for_family(POLICY, CANDIDATES)
    searches = [list(candidates_on_the_margin(rng)) for _ in range(200)]
    with_family = sum(promoted(family, arms) for arms in searches)
    assert with_family / 200 <= 0.025 + 2 * math.sqrt(0.025 * 0.975 / 200), with_family  # 2 Monte Carlo s.e.
    # The first 100 searches judged at the uncorrected 95%: about five times the single rate.
    plain = sum(promoted(POLICY, arms) for arms in searches[:100])
    assert plain / 100 > 0.025 + 2 * math.sqrt(0.025 * 0.975 / 100), plain
