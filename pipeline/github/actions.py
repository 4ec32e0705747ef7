"""The GitHub Actions runner as kiln's CI steps see it: whether they run under Actions, and the
format of a step output. github.py (the run's report) and github_changes.py (the job matrix) both
write step outputs through here."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping


def in_github_actions(env: Mapping[str, str] = os.environ) -> bool:
    return env.get("GITHUB_ACTIONS") == "true"


def output_line(name: str, value: str) -> str:
    """One $GITHUB_OUTPUT entry; multi-line values use a delimiter that cannot occur in them."""
    if "\n" not in value and "\r" not in value:
        return f"{name}={value}\n"
    delimiter = f"ghadelimiter_{uuid.uuid4()}"
    return f"{name}<<{delimiter}\n{value}\n{delimiter}\n"
