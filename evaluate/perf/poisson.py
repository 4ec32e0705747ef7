"""Poisson load: independent arrivals at a mean rate (open loop, exponential gaps, seeded).

Closer to many independent users than `constant`: bursts happen, and a server with no headroom
shows it in the TTFT tail. The same seed gives the same arrival times, so two arms see the same
bursts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Literal

from pydantic import Field

from kiln.evaluate.perf.base import SHAPES, LoadShape, Stage, StageGenerator
from kiln.evaluate.perf.constant import RatesConfig, rate_list


class PoissonConfig(RatesConfig):
    kind: Literal["poisson"] = "poisson"
    rate: float | list[float] = Field(..., description="mean requests/s; a list runs one stage per rate")


def poisson_arrivals(rate: float, seed: int) -> Iterator[float]:
    rng = random.Random(seed)
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


@SHAPES.register("poisson", PoissonConfig)
class Poisson(LoadShape):
    def stages(self) -> StageGenerator:
        for i, r in enumerate(rate_list(self.config.rate)):
            yield Stage(f"poisson@{r:g}", arrivals=poisson_arrivals(r, self.seed * 1000 + i), target_rate=r)
