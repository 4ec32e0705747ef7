"""The load-shape contract: what a shape must say, and the registry every shape joins.

A shape decides *when* requests are sent, never what they contain (that is the workload) or how
they are measured (that is the driver and metrics). It does so as a sequence of stages:

- an **open-loop** stage gives arrival times (seconds from the stage start). Requests go out at
  those times whatever the server is doing, so a slow server shows up as queueing and TTFT;
- a **closed-loop** stage gives a concurrency: that many users, each sending its next request
  when its previous one finishes. It cannot over-load a server, and it hides queueing.

`LoadShape.stages()` is a generator: it yields a `Stage`, receives that stage's `Summary` back,
and may base the next stage on it. Most shapes yield one stage (or one per configured rate);
`sweep` measures the synchronous rate and the maximum throughput first, then steps up to the maximum.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from kiln.core.registry import Registry

if TYPE_CHECKING:
    from kiln.evaluate.perf.metrics import Summary


@dataclass
class Stage:
    """One constant-load measurement. Exactly one of `arrivals` and `concurrency` is set."""

    label: str
    arrivals: Iterator[float] | None = None  # open loop: send times, seconds from stage start
    concurrency: int | None = None  # closed loop: users each waiting for their reply
    target_rate: float | None = None  # open loop: the rate the arrivals are drawn at

    def __post_init__(self) -> None:
        if (self.arrivals is None) == (self.concurrency is None):
            raise ValueError(f"stage {self.label!r}: give arrivals (open loop) or concurrency (closed loop)")

    @property
    def open_loop(self) -> bool:
        return self.arrivals is not None


StageGenerator = Generator[Stage, "Summary", None]


class LoadShape:
    """Base of every shape: built from its config and the run's seed, yields stages."""

    name: ClassVar[str]

    def __init__(self, config: BaseModel, seed: int = 0):
        self.config: Any = config
        self.seed = seed

    def stages(self) -> StageGenerator:
        raise NotImplementedError


SHAPES: Registry[LoadShape] = Registry("load shape", "kind")
