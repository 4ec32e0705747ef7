"""The gate's phases and a family's confidence: which stages decide which check, in what order, and
how strict each check must be when several candidates (or several looks at one) are judged.

The search runs its candidates through `PHASES` and judges each at `for_family`'s policy; the decode
benchmark stops early on the speed checks (`phase_of` says which) at the confidence `for_family`
shares among its rounds. Both read these rules from here.
"""

from __future__ import annotations

from typing import Any

from kiln.core.gate.policy import GateSection
from kiln.core.metrics import LOAD_PREFIX, METRICS
from kiln.evaluate.quality.base import QUALITY_EVALS


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


# Cheap checks first; a candidate that failed one stops there. Perplexity comes before token agreement:
# agreement scores every position against the baseline's full distributions and generates from both
# arms, so it costs 1.5-2x perplexity (demo: 63 s against 40 s for GGUF q5_K_M, which then failed
# perplexity at +12.5% and had no use for its agreement).
PHASES = ("build", "quality", "agreement", "speed", "rest")


def phase_of(check: Any) -> str:
    """The phase whose stages decide `check`: the build (size), the decode benchmark (speed) or the load
    stage (rest) for the performance checks, and for a quality or agreement check the phase of the quality
    eval that measures its metric (perplexity: quality, token agreement: agreement, the served text and
    lm-eval tasks: rest; an eval's own `phase` in kiln.evaluate.quality's registry)."""
    kind, name = check.kind, check.metric
    if kind == "size":
        return "build"
    if kind == "performance":
        return "rest" if name.startswith(LOAD_PREFIX) else "speed"
    if kind in ("quality", "agreement"):
        return _eval_phase(name)
    return "rest"


def _eval_phase(metric: str) -> str:
    """The phase of the registered quality eval that measures `metric` (its `measured_by`,
    evaluate.quality.<eval>); the last phase for a metric no registered eval claims."""
    where = (METRICS[metric].measured_by or "") if metric in METRICS else ""
    section, _, name = where.rpartition(".")
    if section == "evaluate.quality" and name in QUALITY_EVALS.names():
        return QUALITY_EVALS.get(name).phase
    return "rest"


def up_to(policy: GateSection, phase: str) -> GateSection | None:
    """The checks decided by `phase` and the phases before it; None when there is none yet."""
    done = PHASES[: PHASES.index(phase) + 1]
    checks = [c for c in policy.checks if phase_of(c) in done]
    return policy.model_copy(update={"checks": checks}) if checks else None


def objective_phase(objective: str) -> str:
    """The phase whose stage measures `objective`: the decode benchmark (speed), or the load stage (rest)."""
    return "rest" if objective.startswith(LOAD_PREFIX) else "speed"
