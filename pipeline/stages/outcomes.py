"""How a run ends: every ending, its verdict, its exit code and the report's line, in one table.

CI tells endings apart by the exit code alone, so this table is the contract. README.md and
docs/search.md print it (`markdown_table`; a test holds them to it). A run exits 0 only when its
subject (the one candidate, or the search's winner) passed every check of the policy, where
Inconclusive counts as passing only under `gate.on_inconclusive: pass`, in a search exactly as in
a single run, and only when the check had the data to decide: one that measured nothing or too
little (`CheckResult.insufficient`: no requests, one repeat, too few documents or items) blocks
whatever the policy says. So does a check that never ran (the search's budget ran out first, or
the candidate was stopped at an earlier phase): it is never dropped, it is "not judged".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import ExitCode
from kiln.core.gate.base import CheckResult, Verdict
from kiln.core.gate.policy import GateOutcome, combine, rule

NOT_JUDGED = "not judged"


class Ending(enum.StrEnum):
    JUDGED = "one candidate, or the search's winner"  # the gate's own combination
    NO_WINNER = "search: no winner"  # every candidate stopped; the report shows the one that got furthest
    BUDGET = "search: budget ran out"  # no winner, and the budget stopped a candidate before its checks ran
    NOTHING_BUILT = "search: nothing built"  # no candidate could be built
    CHAMPION_KEPT = "search: champion kept"  # the best candidate did not beat the registry's champion


@dataclass(frozen=True)
class Row:
    ending: Ending
    when: str
    verdict: Verdict
    exit_code: ExitCode
    line: str  # the report's first line after the verdict, `{...}` filled by `conclude`


ROWS = (
    Row(Ending.JUDGED, "every check Successful", Verdict.SUCCESSFUL, ExitCode.PASSED,
        "{subject} passed every check"),
    Row(Ending.JUDGED, "a check Inconclusive on enough data (none Failed or Error, none measured too little), "
                       "`on_inconclusive: pass`", Verdict.INCONCLUSIVE,
        ExitCode.PASSED, "{subject}: undecided on {undecided}; `on_inconclusive: pass` accepts that"),
    Row(Ending.JUDGED, "a check Inconclusive (none Failed or Error), `on_inconclusive: fail` (the default); or a "
                       "check that measured nothing or too little (no requests, one repeat, too few documents or "
                       "items) or never ran, whatever `on_inconclusive` says",
        Verdict.INCONCLUSIVE, ExitCode.GATE_INCONCLUSIVE, "{subject}: undecided on {undecided}{too_little}"),
    Row(Ending.JUDGED, "a check Failed", Verdict.FAILED, ExitCode.GATE_FAILED, "{subject} failed {failed}"),
    Row(Ending.JUDGED, "a check Error (none Failed)", Verdict.ERROR, ExitCode.INTERNAL_ERROR,
        "{subject}: a check could not run: {errors}"),
    Row(Ending.NO_WINNER, "the candidate that got furthest Failed a check", Verdict.FAILED, ExitCode.GATE_FAILED,
        "no candidate passed every check; shown: {subject}, which got furthest and failed {failed}"),
    Row(Ending.NO_WINNER, "... was Inconclusive (none Failed or Error)", Verdict.INCONCLUSIVE,
        ExitCode.GATE_INCONCLUSIVE, "no candidate passed every check; shown: {subject}, which got furthest, "
                                    "undecided on {undecided}"),
    Row(Ending.NO_WINNER, "... had a check Error (none Failed)", Verdict.ERROR, ExitCode.INTERNAL_ERROR,
        "no candidate passed every check; shown: {subject}, which got furthest: a check could not run: {errors}"),
    Row(Ending.BUDGET, "no winner, and the search budget stopped a candidate before all its checks ran "
                       "(before any was built: no report, the message names the budget)",
        Verdict.INCONCLUSIVE, ExitCode.GATE_INCONCLUSIVE,
        "not judged: {detail}; shown: {subject}, which got furthest (Failed: {failed}; undecided or never ran: "
        "{undecided})"),
    Row(Ending.NOTHING_BUILT, "no candidate could be built (no report: the message gives each one's reason)", Verdict.FAILED, ExitCode.GATE_FAILED,
        "no candidate could be built: {detail}"),
    Row(Ending.CHAMPION_KEPT, "the best candidate passed against the checkpoint but did not beat the champion",
        Verdict.FAILED, ExitCode.GATE_FAILED, "the champion stays: {detail}"),
)


def row_for(ending: Ending, verdict: Verdict, exit_code: ExitCode) -> Row:
    """The table's row for an ending with this verdict and code."""
    for row in ROWS:
        if row.ending is ending and row.verdict is verdict and row.exit_code is exit_code:
            return row
    raise ValueError(f"no row for {ending.value}, {verdict.value}, exit {int(exit_code)}")  # a bug: the table is complete


def not_judged(config: Any, why: str) -> CheckResult:
    """A check of the policy that never ran: it measured nothing, so it blocks whatever
    `on_inconclusive` says."""
    return CheckResult(name=config.label, kind=config.kind, metric=config.metric, verdict=Verdict.INCONCLUSIVE,
                       observed=None, baseline=None, threshold="", reason=f"{NOT_JUDGED}: {why}", insufficient=True)


def conclude(results: list[CheckResult], on_inconclusive: str, ending: Ending, subject: str,
             detail: str = "") -> GateOutcome:
    """The run's outcome from its subject's check results: the verdict and exit code of the gate's
    rule, then the table's row for `ending`. A check not judged, or judged on too little data, never
    lets the run exit 0."""
    verdict, code = combine(results, on_inconclusive)  # a check not judged is insufficient: combine blocks it
    if ending is Ending.NO_WINNER and code is ExitCode.PASSED:  # only a winner passes
        verdict, code = Verdict.INCONCLUSIVE, ExitCode.GATE_INCONCLUSIVE
    if ending in (Ending.NOTHING_BUILT, Ending.CHAMPION_KEPT):
        verdict, code = Verdict.FAILED, ExitCode.GATE_FAILED
    if ending is Ending.BUDGET:  # a candidate the budget stopped might have won: the search decided nothing
        verdict, code = Verdict.INCONCLUSIVE, ExitCode.GATE_INCONCLUSIVE
    row = row_for(ending, verdict, code)

    def names(*verdicts: Verdict) -> str:
        return ", ".join(r.name for r in results if r.verdict in verdicts) or "—"

    short = [r.name for r in results if r.verdict is Verdict.INCONCLUSIVE and r.insufficient]
    too_little = (f" ({', '.join(short)} measured nothing or too little to decide, which no `on_inconclusive` "
                  "accepts)") if short and on_inconclusive == "pass" else ""
    line = row.line.format(subject=subject, detail=detail, failed=names(Verdict.FAILED), errors=names(Verdict.ERROR),
                           undecided=names(Verdict.INCONCLUSIVE), too_little=too_little)
    return GateOutcome(verdict, results, code, rule(on_inconclusive), summary=line)


def markdown_table() -> str:
    """The table as README.md and docs/search.md print it."""
    lines = ["| how the run ends | when | verdict | exit code |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.ending.value} | {r.when} | {r.verdict.value} | {int(r.exit_code)} |" for r in ROWS]
    return "\n".join(lines)
