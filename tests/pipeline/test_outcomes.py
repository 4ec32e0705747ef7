"""The one table of endings: each row reached by `conclude`, with its verdict and exit code, and
README.md and docs/search.md printing the same table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.core.errors import ExitCode
from kiln.core.gate.base import CheckResult, Verdict
from kiln.core.gate.policy import GateSection
from kiln.pipeline.stages.outcomes import ROWS, Ending, conclude, markdown_table, not_judged

ROOT = Path(__file__).resolve().parents[2]
POLICY = GateSection.model_validate({"checks": [
    {"kind": "size", "max_ratio": 1.0},
    {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 2.0}]})
S, F, I, E = Verdict.SUCCESSFUL, Verdict.FAILED, Verdict.INCONCLUSIVE, Verdict.ERROR


def _result(verdict: Verdict, name: str = "size:size_bytes", insufficient: bool = False) -> CheckResult:
    return CheckResult(name=name, kind="size", metric="size_bytes", verdict=verdict, observed=1.0, baseline=1.0,
                       threshold="≤ 1", reason="measured", insufficient=insufficient)


NEVER_RAN = not_judged(POLICY.checks[1], "the search budget (3 s) ran out before its speed stages")

# One case per row of the table: (ending, results, on_inconclusive) -> (verdict, exit code).
CASES = [
    (Ending.JUDGED, [_result(S)], "fail", S, ExitCode.PASSED),
    (Ending.JUDGED, [_result(S), _result(I, "q")], "pass", I, ExitCode.PASSED),
    (Ending.JUDGED, [_result(S), _result(I, "q")], "fail", I, ExitCode.GATE_INCONCLUSIVE),
    (Ending.JUDGED, [_result(S), _result(I, "q", insufficient=True)], "pass", I, ExitCode.GATE_INCONCLUSIVE),
    (Ending.JUDGED, [_result(F), _result(E, "q")], "pass", F, ExitCode.GATE_FAILED),
    (Ending.JUDGED, [_result(E), _result(I, "q")], "pass", E, ExitCode.INTERNAL_ERROR),
    (Ending.NO_WINNER, [_result(F), NEVER_RAN], "fail", F, ExitCode.GATE_FAILED),
    (Ending.NO_WINNER, [_result(I), NEVER_RAN], "pass", I, ExitCode.GATE_INCONCLUSIVE),
    (Ending.NO_WINNER, [_result(E), NEVER_RAN], "fail", E, ExitCode.INTERNAL_ERROR),
    (Ending.BUDGET, [_result(S), NEVER_RAN], "pass", I, ExitCode.GATE_INCONCLUSIVE),
    (Ending.NOTHING_BUILT, [], "pass", F, ExitCode.GATE_FAILED),
    (Ending.CHAMPION_KEPT, [_result(S), _result(F, "beats champion v1")], "pass", F, ExitCode.GATE_FAILED),
]


@pytest.mark.parametrize(("ending", "results", "on_inconclusive", "verdict", "code"), CASES)
def test_each_ending_has_one_verdict_one_exit_code_and_one_line(ending, results, on_inconclusive, verdict, code):
    outcome = conclude(results, on_inconclusive, ending, "cand", detail="the search budget (3 s) ran out")
    assert (outcome.verdict, outcome.exit_code) == (verdict, code)
    [row] = [r for r in ROWS if r.ending is ending and r.verdict is verdict and r.exit_code is code]
    head = row.line.split("{")[0]
    assert outcome.summary.startswith(head) and "{" not in outcome.summary, outcome.summary


def test_the_cases_reach_every_row():
    reached = {(e, v, c) for e, _, _, v, c in CASES}
    assert reached == {(r.ending, r.verdict, r.exit_code) for r in ROWS}


@pytest.mark.parametrize("on_inconclusive", ["pass", "fail"])
def test_a_check_that_never_ran_never_passes(on_inconclusive):
    """Even where Inconclusive passes, a check that was never measured blocks: exit 3."""
    outcome = conclude([_result(S), NEVER_RAN], on_inconclusive, Ending.JUDGED, "cand")
    assert outcome.exit_code is ExitCode.GATE_INCONCLUSIVE
    outcome = conclude([_result(S), NEVER_RAN], on_inconclusive, Ending.BUDGET, "cand", detail="budget")
    assert outcome.exit_code is ExitCode.GATE_INCONCLUSIVE and "not judged: budget" in outcome.summary


def test_only_a_winner_exits_zero():
    for results in ([_result(S)], [_result(S), _result(I, "q")]):
        assert conclude(results, "pass", Ending.NO_WINNER, "cand").exit_code is not ExitCode.PASSED


@pytest.mark.parametrize("doc", ["README.md", "docs/search.md"])
def test_the_docs_print_the_table_the_code_follows(doc):
    assert markdown_table() in (ROOT / doc).read_text(), f"{doc}: paste kiln.pipeline.stages.outcomes.markdown_table()"


def test_a_check_that_measured_too_little_never_passes_and_the_line_says_why():
    """`on_inconclusive: pass` accepts an interval too wide to decide, not a check with no data to decide on."""
    empty = _result(I, "error_rate:error_rate", insufficient=True)
    outcome = conclude([_result(S), empty], "pass", Ending.JUDGED, "cand")
    assert (outcome.verdict, outcome.exit_code) == (I, ExitCode.GATE_INCONCLUSIVE)
    assert "error_rate:error_rate measured nothing or too little" in outcome.summary, outcome.summary
    assert "accepts that" not in outcome.summary and "unless a check measured nothing" in outcome.rule
    assert NEVER_RAN.insufficient and NEVER_RAN.to_dict()["insufficient"] is True
    assert conclude([_result(S), _result(I, "q")], "pass", Ending.JUDGED, "cand").exit_code is ExitCode.PASSED
