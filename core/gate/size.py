"""Size check: the candidate's checkpoint against a byte budget or the baseline's size.

Sizes are exact, so this check has no interval: it is Successful or Failed.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kiln.core.gate.base import CHECKS, Check, CheckConfig, CheckResult, Evidence, Verdict
from kiln.core.units import amount


class SizeCheckConfig(CheckConfig):
    reads: ClassVar[str] = "size"
    kind: Literal["size"] = "size"
    metric: Literal["size_bytes"] = "size_bytes"
    max_ratio: float | None = Field(None, gt=0, description="candidate size / baseline size at most this")
    max_bytes: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_bound(self) -> SizeCheckConfig:
        if (self.max_ratio is None) == (self.max_bytes is None):
            raise ValueError("set exactly one of max_ratio, max_bytes")
        return self


@CHECKS.register("size", SizeCheckConfig)
class SizeCheck(Check):
    def check(self, candidate: Evidence, baseline: Evidence) -> CheckResult:
        c: SizeCheckConfig = self.config  # type: ignore[assignment]
        size, base = candidate.metrics["size_bytes"], baseline.metrics["size_bytes"]
        if c.max_ratio is not None:
            ratio = size / base
            ok, threshold = ratio <= c.max_ratio, f"ratio ≤ {c.max_ratio:g}"
            reason = f"{amount('size_bytes', size)} is {ratio:.3f}× the baseline's {amount('size_bytes', base)}"
        else:
            ok, threshold = size <= c.max_bytes, f"≤ {amount('size_bytes', c.max_bytes)}"  # never 200000000 bytes
            reason = amount("size_bytes", size)
        return self.result(Verdict.SUCCESSFUL if ok else Verdict.FAILED, observed=size, baseline=base,
                           threshold=threshold, method="exact", reason=reason)
