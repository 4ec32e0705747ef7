"""The gate policy: the recipe's list of checks and the rule that combines their verdicts.

One policy judges a candidate offline (`kiln run`) and the live canary later (`kiln deploy`):
both build `Evidence` for each arm and call `judge`.

Combining rule, explicit and in one place:
- any check Failed            -> Failed        (exit 1)
- else any check Error        -> Error         (exit 4)
- else any check Inconclusive on too little data (`insufficient`: no requests, one repeat, too few
  documents or items to pass, a check that never ran)
                              -> Inconclusive  (exit 3, whatever `on_inconclusive` says)
- else any check Inconclusive -> Inconclusive  (exit 3, or 0 when `on_inconclusive: pass`)
- else                        -> Successful    (exit 0)
`on_inconclusive: pass` accepts an interval too wide to decide, never a check that measured
nothing or too little.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.core.errors import BadInput, ExitCode
from kiln.core.gate.base import CHECKS, CheckResult, Evidence, Verdict

CheckConfigUnion = CHECKS.config_union()


class GateSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="confidence level of every interval")
    on_inconclusive: Literal["fail", "pass"] = Field(
        "fail", description="'fail': an undecided check blocks (exit 3); 'pass': it does not, unless it measured "
                            "nothing or too little to decide (no requests, one repeat, too few documents or items)")
    checks: Annotated[list[CheckConfigUnion], Field(min_length=1)]  # type: ignore[valid-type]


@dataclass
class GateOutcome:
    verdict: Verdict
    results: list[CheckResult]
    exit_code: ExitCode
    rule: str
    summary: str = ""  # how the run ended, in one line (kiln.pipeline.stages.outcomes)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "exit_code": int(self.exit_code), "rule": self.rule,
                "summary": self.summary, "checks": [r.to_dict() for r in self.results]}


def combine(results: list[CheckResult], on_inconclusive: str) -> tuple[Verdict, ExitCode]:
    verdicts = {r.verdict for r in results}
    for v, code in ((Verdict.FAILED, ExitCode.GATE_FAILED), (Verdict.ERROR, ExitCode.INTERNAL_ERROR)):
        if v in verdicts:
            return v, code
    if Verdict.INCONCLUSIVE in verdicts:
        short = any(r.insufficient for r in results if r.verdict is Verdict.INCONCLUSIVE)
        waived = on_inconclusive == "pass" and not short
        return Verdict.INCONCLUSIVE, ExitCode.PASSED if waived else ExitCode.GATE_INCONCLUSIVE
    return Verdict.SUCCESSFUL, ExitCode.PASSED


def judge(policy: GateSection, candidate: Evidence, baseline: Evidence) -> GateOutcome:
    """Run every check; a check that raises is an Error result, not a crash of the gate."""
    results = []
    for cfg in policy.checks:
        check = CHECKS.create(cfg, confidence=policy.confidence)
        try:
            results.append(check.check(candidate, baseline))
        except BadInput:
            raise
        except Exception as e:  # noqa: BLE001 - reported as the check's verdict
            results.append(check.result(Verdict.ERROR, observed=None, baseline=None, threshold="",
                                        reason=f"{type(e).__name__}: {e}"))
    verdict, code = combine(results, policy.on_inconclusive)
    return GateOutcome(verdict, results, code, rule(policy.on_inconclusive))


def rule(on_inconclusive: str) -> str:
    """`combine`'s rule in one line, as reports print it."""
    if on_inconclusive == "pass":
        return "any Failed fails; Inconclusive passes unless a check measured nothing or too little"
    return "any Failed fails; Inconclusive fails"
