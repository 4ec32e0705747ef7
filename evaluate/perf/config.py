"""`PerformanceConfig`: the recipe's `evaluate.load` section (and `tune.load`), validated in one object.

Defaults fit the 2-core CPU demo (a 135M model served on CPU): 4 closed-loop users for 20 s
per stage, 128-token synthetic prompts, 32 output tokens, SLOs a CPU engine can meet. A GPU
recipe sets its own shape, rates and SLOs.
"""

from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import Field, model_validator

# Importing the shape modules registers them; the union below is built from the registry.
from kiln.evaluate.perf import concurrent, constant, poisson, sweep, synchronous  # noqa: F401
from kiln.evaluate.perf.base import SHAPES
from kiln.evaluate.perf.concurrent import ConcurrentConfig
from kiln.evaluate.perf.prefix import PrefixConfig
from kiln.evaluate.perf.rules import SLO, SaturationRule, Strict

__all__ = ["SLO", "LengthDistribution", "PerformanceConfig", "SaturationRule", "Trim", "WorkloadConfig"]

ShapeConfig = SHAPES.config_union()


class LengthDistribution(Strict):
    """Token lengths drawn from a normal distribution, rounded and clipped to [min, max]."""

    mean: int = Field(..., ge=1)
    stdev: float = Field(0.0, ge=0)
    min: int = Field(1, ge=1)
    max: int | None = Field(None, ge=1)

    def sample(self, rng: random.Random) -> int:
        n = self.mean if self.stdev == 0 else round(rng.gauss(self.mean, self.stdev))
        return max(self.min, min(n, self.max or n))


class WorkloadConfig(Strict):
    dataset: str | None = Field(
        None, description="'demo' (GSM8K questions), a JSONL path, or None for synthetic token-id prompts"
    )
    prompt_field: str = Field("prompt", description="the JSONL field holding each prompt")
    input_tokens: LengthDistribution = Field(
        default_factory=lambda: LengthDistribution(mean=128), description="synthetic prompt lengths"
    )
    token_id_range: tuple[int, int] = Field((1000, 10000), description="synthetic token ids are drawn from [low, high)")
    shared_prefix_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of each prompt that is a prefix common to every request"
    )
    unique: bool = Field(True, description="mark every prompt unique, so a prefix cache cannot flatter the result")
    prefixes: int = Field(1, ge=1, description="distinct shared prefixes; each request draws one (seeded)")
    cache_prompt: bool | None = Field(
        None, description="send llama.cpp's cache_prompt (false: the server must not reuse its prompt cache); None: unsent"
    )

    @model_validator(mode="after")
    def _range(self) -> WorkloadConfig:
        low, high = self.token_id_range
        if not 0 <= low < high or high - low < 16:
            raise ValueError("token_id_range must be [low, high) with 0 <= low and at least 16 ids")
        return self


class Trim(Strict):
    """A stretch excluded from results: by time, by request count, or both (the longer wins)."""

    seconds: float = Field(0.0, ge=0)
    requests: int = Field(0, ge=0)


class PerformanceConfig(Strict):
    shape: ShapeConfig = Field(default_factory=ConcurrentConfig)  # type: ignore[valid-type]
    endpoint: Literal["completions", "chat"] = "completions"
    duration_s: float = Field(20.0, gt=0, description="length of each stage")
    max_requests: int | None = Field(None, ge=1, description="per stage; whichever of this and duration_s comes first")
    warmup: Trim = Field(default_factory=lambda: Trim(seconds=2.0))
    cooldown: Trim = Field(default_factory=lambda: Trim(seconds=2.0))
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    output_tokens: int = Field(
        32, ge=1, description="fixed output length (ignore_eos), so no config looks faster by stopping early"
    )
    slo: SLO = Field(default_factory=SLO)
    price_per_hour: float | None = Field(None, gt=0, description="machine price, for cost per 1M output tokens")
    repeats: int = Field(3, ge=1, description="interleaved baseline/candidate repeats in a comparison")
    seed: int = 0
    saturation: SaturationRule = Field(default_factory=SaturationRule)
    request_timeout_s: float = Field(300.0, gt=0)
    drain_timeout_s: float = Field(120.0, gt=0, description="wait this long for in-flight requests after a stage")
    prefix: PrefixConfig | None = Field(
        None, description="also run the prefix-sharing workload with and without the prompt cache (load stage)"
    )

    @model_validator(mode="after")
    def _trims_fit(self) -> PerformanceConfig:
        if self.warmup.seconds + self.cooldown.seconds >= self.duration_s:
            raise ValueError(
                f"warmup.seconds + cooldown.seconds ({self.warmup.seconds:g} + {self.cooldown.seconds:g}) "
                f"must be less than duration_s ({self.duration_s:g}), or nothing is measured"
            )
        trimmed = self.warmup.requests + self.cooldown.requests
        if self.max_requests is not None and trimmed >= self.max_requests:
            raise ValueError(
                f"warmup.requests + cooldown.requests ({trimmed}) must be less than max_requests ({self.max_requests})"
            )
        if not math.isfinite(self.duration_s):
            raise ValueError("duration_s must be finite")
        return self
