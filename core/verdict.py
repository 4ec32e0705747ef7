"""The four outcomes of a check, shared by the offline gate, the statistics and the canary."""

import enum


class Verdict(enum.StrEnum):
    """Outcome of a check. Error (the check could not run) is kept apart from Failed, as Argo
    Rollouts does: a broken measurement must never read as a regression or as a pass."""

    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"


def percent(confidence: float) -> str:
    """95% or 98.33%: a confidence as a verdict was taken at it, never rounded to a level it was not."""
    return f"{confidence:.2%}".replace(".00%", "%")
