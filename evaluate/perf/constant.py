"""Constant-rate load: requests at evenly spaced times, whatever the server does (open loop).

The cleanest test of "can this server take R requests per second": if it cannot, queueing shows
in TTFT and in requests piling up, instead of the load quietly backing off.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.evaluate.perf.base import SHAPES, LoadShape, Stage, StageGenerator


def rate_list(rate: float | list[float]) -> list[float]:
    rates = rate if isinstance(rate, list) else [rate]
    if not rates or any(r <= 0 for r in rates):
        raise ValueError("rates must be positive (requests per second)")
    return rates


class RatesConfig(BaseModel):
    """Base of an open-loop shape's config: its `rate` field (one rate, or a list run one stage
    per rate) holds only positive rates."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("rate", check_fields=False)
    @classmethod
    def _positive(cls, v: float | list[float]) -> float | list[float]:
        rate_list(v)
        return v


class ConstantConfig(RatesConfig):
    kind: Literal["constant"] = "constant"
    rate: float | list[float] = Field(..., description="requests/s; a list runs one stage per rate")


def constant_arrivals(rate: float) -> Iterator[float]:
    return (i / rate for i in itertools.count())


@SHAPES.register("constant", ConstantConfig)
class Constant(LoadShape):
    def stages(self) -> StageGenerator:
        for r in rate_list(self.config.rate):
            yield Stage(f"constant@{r:g}", arrivals=constant_arrivals(r), target_rate=r)
