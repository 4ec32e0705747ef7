"""Concurrent load: a fixed number of users, each sending when its last reply ends (closed loop).

Good for comparing throughput of two configurations at the same number of users. It slows down
when the server slows down, so it can never show queueing: use `constant` or `poisson` for that.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.evaluate.perf.base import SHAPES, LoadShape, Stage, StageGenerator


class ConcurrentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["concurrent"] = "concurrent"
    concurrency: int | list[int] = Field(4, description="users; a list runs one stage per value")

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: int | list[int]) -> int | list[int]:
        levels = v if isinstance(v, list) else [v]
        if not levels or any(c < 1 for c in levels):
            raise ValueError("concurrency must be at least 1 (a list must not be empty)")
        return v

    def levels(self) -> list[int]:
        return self.concurrency if isinstance(self.concurrency, list) else [self.concurrency]


@SHAPES.register("concurrent", ConcurrentConfig)
class Concurrent(LoadShape):
    def stages(self) -> StageGenerator:
        for c in self.config.levels():
            yield Stage(f"concurrent@{c}", concurrency=c)
