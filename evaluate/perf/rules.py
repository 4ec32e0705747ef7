"""The rules a load stage is judged by: the SLO that goodput counts against, and the saturation
rule that stops an open-loop stage early and says whom to blame.

They sit below config.py (the whole `evaluate.load` section, which imports every load shape) so
that metrics.py can read them without importing the shapes, whose stages carry metrics' Summary.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """A config section in which an unknown key is an error, never a silent default."""

    model_config = ConfigDict(extra="forbid")


class SLO(Strict):
    ttft_p95_ms: float = Field(2000.0, gt=0)
    tpot_p95_ms: float = Field(200.0, gt=0)


class SaturationRule(Strict):
    """When an open-loop stage stops early, and whom it blames: the server or the client.

    Every `check_interval_s` after warm-up the driver counts requests in flight. When that count
    rose at each of the last `rising_checks` checks AND is at least `growth` times the count at
    the first check after warm-up (and at least `min_in_flight`), requests arrive faster than they
    finish and the stage stops. If the client was behind schedule by more than
    `send_lag_tolerance_ms` at each of the last two checks, it could not send the target rate and
    its queued requests are what grew: "client-limited". Otherwise the server could not keep up:
    "over-saturated" (a client that stalled once and caught up is on time at the next check). It
    also stops, client-limited, when sends fall more than `max_lateness_s` behind the schedule.
    `enabled: false` turns off the early stop, not the labelling.

    Why 50 ms of p99 lag: a lag that stays under it moves the rate the server sees by under 2%
    over any window of 2.5 s or more, while a client that cannot keep up falls behind without
    bound and crosses it within 50 ms / shortfall (0.5 s at 10% short). It sits well above the
    event loop's ~1 ms timer granularity and the 11 ms p99 loopback jitter of a busy 2-core
    machine, so a client that keeps up is not called late. (A tolerance relative to the mean gap
    between arrivals would be under a millisecond at hundreds of requests per second: jitter alone
    would trip it.)
    """

    enabled: bool = True
    check_interval_s: float = Field(0.5, gt=0)
    rising_checks: int = Field(4, ge=1)
    growth: float = Field(2.0, gt=1)
    min_in_flight: int = Field(8, ge=1)
    max_lateness_s: float = Field(1.0, gt=0)
    send_lag_tolerance_ms: float = Field(
        50.0, gt=0, description="p99 send lag (actual - scheduled) beyond which a stage is client-limited"
    )
