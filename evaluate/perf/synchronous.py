"""Synchronous load: one user, next request the moment the previous one ends (closed loop, 1).

The best-case latency of a server and the rate it sustains with no batching at all. It is the
floor `sweep` starts from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from kiln.evaluate.perf.base import SHAPES, LoadShape, Stage, StageGenerator


class SynchronousConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["synchronous"] = "synchronous"


@SHAPES.register("synchronous", SynchronousConfig)
class Synchronous(LoadShape):
    def stages(self) -> StageGenerator:
        yield Stage("synchronous", concurrency=1)
