"""Exit codes and the errors that map onto them.

CI tells outcomes apart by exit code alone, so every way kiln can end has its own:

| code | meaning |
| ---- | ------- |
| 0 | passed: every gate check Successful (or the policy accepts what is left) |
| 1 | gate failed: at least one check Failed |
| 2 | bad input: recipe, file or argument is wrong; the message names it and the fix |
| 3 | gate inconclusive: the data cannot decide, and the policy does not accept that |
| 4 | internal error: a bug or an environment failure; the traceback is in the run's log |
| 5 | not verified: evidence or an artifact does not match its signed record, or no trusted key signed it |
| 130 | interrupted (SIGINT); `kiln run` again resumes |
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    PASSED = 0
    GATE_FAILED = 1
    BAD_INPUT = 2
    GATE_INCONCLUSIVE = 3
    INTERNAL_ERROR = 4
    NOT_VERIFIED = 5
    INTERRUPTED = 130


class KilnError(Exception):
    """Base for errors kiln reports to the user without a traceback."""

    exit_code = ExitCode.INTERNAL_ERROR


class BadInput(KilnError):
    """The user's input is wrong. The message must name the field or file and the fix.

    `problems` holds one line per problem when there are several (a recipe with three typos
    reports all three at once).
    """

    exit_code = ExitCode.BAD_INPUT

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or []

    def __str__(self) -> str:
        head = super().__str__()
        return "\n".join([head, *(f"  {p}" for p in self.problems)]) if self.problems else head


class NotVerified(KilnError):
    """Evidence or an artifact does not match what was signed, or no trusted key signed it
    (`kiln verify`, and every command that moves or serves a version). The message names what."""

    exit_code = ExitCode.NOT_VERIFIED


class DoesNotFit(BadInput):
    """A step would not fit in memory; raised before anything is loaded, with the numbers."""
