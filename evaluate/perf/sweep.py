"""Sweep: find where a server saturates, then step the request rate up to it.

1. `synchronous` (one user) measures the rate a server sustains with no batching;
2. `concurrent` at `max_concurrency` users measures its maximum request throughput;
3. `steps` open-loop stages at rates evenly spaced from maximum/steps up to the maximum.

The lowest rates sit well below saturation, so the curve starts where latency is flat and the
knee shows. (Spacing them above the synchronous rate, as GuideLLM does, leaves no unloaded point
when batching buys little, as on a 2-core CPU: every stage then queues.)

The result is a latency-versus-load curve. Its knee (where latency starts climbing fast; see
`metrics.find_knee`) is the server's real capacity: beyond it more load buys queueing, not
throughput. Stages past saturation stop early (see the driver's over-saturation rule).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.evaluate.perf.base import SHAPES, LoadShape, Stage, StageGenerator
from kiln.evaluate.perf.constant import constant_arrivals
from kiln.evaluate.perf.poisson import poisson_arrivals


class SweepConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["sweep"] = "sweep"
    steps: int = Field(5, ge=1, description="open-loop rates between the synchronous and maximum rate")
    max_concurrency: int = Field(32, ge=1, description="users for the maximum-throughput stage")
    arrivals: Literal["constant", "poisson"] = "constant"


def sweep_rates(low: float, high: float, steps: int) -> list[float]:
    """`steps` rates evenly spaced up to the maximum sustained rate (`high`, or the synchronous
    rate `low` when batching bought nothing), the first at maximum/steps."""
    top = max(low, high)
    return [top * k / steps for k in range(1, steps + 1)]


@SHAPES.register("sweep", SweepConfig)
class Sweep(LoadShape):
    def stages(self) -> StageGenerator:
        cfg = self.config
        sync = yield Stage("synchronous", concurrency=1)
        peak = yield Stage(f"throughput@{cfg.max_concurrency}", concurrency=cfg.max_concurrency)
        low, high = sync.request_throughput, peak.request_throughput
        if not low or not high:
            raise RuntimeError(
                f"sweep: no request completed in the probe stages ({sync.error_summary or peak.error_summary})"
            )
        for i, rate in enumerate(sweep_rates(low, high, cfg.steps)):
            arrivals = (
                constant_arrivals(rate) if cfg.arrivals == "constant" else poisson_arrivals(rate, self.seed * 1000 + i)
            )
            yield Stage(f"{cfg.arrivals}@{rate:.3g}", arrivals=arrivals, target_rate=rate)
