"""Where a search's candidates run (`search.executor`): here, one after another, or on a Ray cluster.

The search (kiln.pipeline.search.search) owns what is judged: the phases, the elimination after each, the
family's confidence, the winner's confirmation and the report. An executor decides only where one
candidate's stages of one phase run. `local` runs them in this process when they are started;
`ray` (kiln.pipeline.search.ray_executor) sends each to a node of a Ray cluster and brings back what its
stages wrote through the tracking server, as stage reuse does.

A phase of several candidates is started for each of them, then finished for each in the same
order: the search judges a candidate only once its stages are done, so with `local` nothing changes
from running them one by one, and with `ray` the candidates of a phase run side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

# The winner's fresh, held-out benchmark after the search's phases: an executor runs it as a phase.
CONFIRM = "confirm"


class Executor(Protocol):
    def start(self, arm: Any, phase: str) -> Any:
        """Begin `arm`'s stages of `phase` (or CONFIRM); returns what `finish` waits on."""

    def finish(self, arm: Any, job: Any) -> None:
        """Wait for `job`; then `arm`'s stage records (its run_dir/stages), `engines`, `artifact`
        and `eliminated` are as if the phase had run here."""

    def bring_back(self, arm: Any) -> None:
        """Make `arm.artifact` registrable by the report: a folder on this machine, or already
        uploaded whole to this run's `model/` (kiln.pipeline.tracking.registry.upload)."""

    def close(self) -> None:
        """Let go of whatever the executor holds (a cluster connection)."""


class LocalExecutor:
    """Each phase runs in this process as it is started, in the search's order."""

    def __init__(self, run: Callable[[Any, str], None]):
        self.run = run

    def start(self, arm: Any, phase: str) -> None:
        self.run(arm, phase)

    def finish(self, arm: Any, job: Any) -> None:
        return None

    def bring_back(self, arm: Any) -> None:
        return None

    def close(self) -> None:
        return None
