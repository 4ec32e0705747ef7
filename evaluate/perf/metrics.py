"""Turn per-request records into the numbers a gate and a capacity plan read.

The measurement window is [warm-up end, cool-down start]. Within it:
- latency percentiles (TTFT, TPOT, ITL, e2e, client queue time) cover requests *scheduled*
  in the window; every one of them ran to completion, because the driver drains in-flight
  requests instead of cancelling them;
- request throughput counts completions inside the window, output-token throughput counts
  token arrivals inside the window (each chunk's timestamp), both divided by the window length
  (the window opens no earlier than the first completion; see `flow_window`).
  Load keeps running before and after the window, so nothing in flight at its edges is lost:
  the ~1.8% undercount of generators that divide finished requests by the whole run is gone;
- achieved rate is the rate requests were actually *sent* in the window: from the spacing of
  the moments their bytes went to the socket (never their scheduled times, nor completions), to
  put beside the target rate;
- send lag (actual send - scheduled send; p50, p99, max) says whether the client kept to the
  schedule. An open-loop stage is `limited_by` "server" when it stopped because requests in
  flight kept growing while sends were on time, and "client" when it stopped because the client
  fell behind or (not stopped so) its p99 lag exceeds the tolerance
  (`SaturationRule.send_lag_tolerance_ms`).
  A client-limited stage measured the client, not the server: the knee finder skips it and a
  search must not rank on it (`client_limited`).

The cache hit rate is the share of prompt tokens the server served from its prompt cache, over the
completed requests whose usage said (`usage.prompt_tokens_details.cached_tokens`); None when none did.

Goodput is the rate of requests that met the SLO on both TTFT and TPOT (DistServe's honest
throughput). Percentiles use numpy's default (linear interpolation).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.evaluate.capacity import cost_per_million
from kiln.evaluate.perf.client import RequestRecord
from kiln.evaluate.perf.rules import SLO, SaturationRule

PERCENTILES = (50, 90, 95, 99)
CLIENT, SERVER = "client", "server"  # the values of Summary.limited_by
# How an early-stop reason starts says whom it blames; the driver writes them, `limited_by` reads them.
CLIENT_LIMITED = "client-limited"
OVER_SATURATED = "over-saturated"


def describe_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean and percentiles in milliseconds (NaN when there is nothing to describe)."""
    if not len(values_s):
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=float) * 1000
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


@dataclass
class Summary:
    """The aggregate of one stage. Rates are per second over the window; latencies in ms."""

    label: str
    window_s: float
    requests: int
    completed: int
    errors: int
    cancelled: int
    target_rate: float | None
    concurrency: int | None
    achieved_rate: float
    request_throughput: float
    output_token_throughput: float
    goodput: float
    slo_attainment: float
    slo_met: bool
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    queue_ms: dict[str, float]
    cost_per_1m_output_tokens: float | None = None
    stopped_early: str | None = None
    error_summary: str | None = None
    limited_by: str | None = None  # open loop: "client" (sends fell behind), "server" (in flight grew), None
    send_lag_ms: dict[str, float] = field(default_factory=dict)  # actual - scheduled send: p50, p99, max
    cache_hit_rate: float | None = None  # prompt tokens served from the server's prompt cache / prompt tokens
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return self.errors / max(1, self.requests - self.cancelled)

    def flat(self) -> dict[str, float]:
        """Scalar metrics with unit-suffixed names (what the lead logs to MLflow)."""
        out = {
            k: float(v)
            for k, v in asdict(self).items()
            if isinstance(v, int | float) and v is not None and not isinstance(v, bool)
        }
        out["error_rate"] = self.error_rate
        for name in ("ttft", "tpot", "itl", "e2e", "queue", "send_lag"):
            for stat, v in getattr(self, f"{name}_ms").items():
                out[f"{name}_{stat}_ms"] = v
        return out


def _tokens_in(rec: RequestRecord, w0: float, w1: float) -> float:
    """Output tokens that arrived in [w0, w1); chunks carrying several tokens count them all."""
    t = rec.chunk_times
    if not t or rec.error:
        return 0.0
    per_chunk = rec.output_tokens / len(t) if rec.output_tokens else 1.0
    return (bisect.bisect_left(t, w1) - bisect.bisect_left(t, w0)) * per_chunk


def flow_window(records: Sequence[RequestRecord], window: tuple[float, float]) -> tuple[float, float]:
    """The stretch over which completions and tokens are counted.

    Nothing completes until one request latency after load starts, so a warm-up shorter than
    that would count an empty start. The flow window therefore opens no earlier than the first
    completion. (Not the median latency: under overload latency grows without bound and the
    window would never open, while completions flow at the server's real rate from the start.)
    """
    w0, w1 = window
    done = [r.done for r in records if r.ok and r.done is not None]
    if done:
        w0 = max(w0, min(done))
    return w0, max(w0, w1)


def summarize(
    records: Sequence[RequestRecord],
    window: tuple[float, float],
    slo: SLO,
    *,
    label: str = "",
    target_rate: float | None = None,
    concurrency: int | None = None,
    price_per_hour: float | None = None,
    stopped_early: str | None = None,
    saturation: SaturationRule | None = None,
) -> Summary:
    """Aggregate one stage over its measurement `window` (perf_counter seconds).

    `saturation` gives the send-lag tolerance that marks an open-loop stage client-limited
    (default: the config's default rule)."""
    w0, w1 = window
    span = max(w1 - w0, 1e-9)
    inside = [r for r in records if w0 <= r.scheduled < w1]
    failed = [r for r in inside if r.error and r.error != "cancelled"]
    ok = [r for r in inside if r.ok]
    good = _within_slo(ok, slo)
    flow = _flow(records, window)
    latency = _latencies(inside, ok)
    lag = send_lag_ms(inside)
    tolerance_ms = (saturation or SaturationRule()).send_lag_tolerance_ms
    return Summary(
        label=label,
        window_s=span,
        requests=len(inside),
        completed=len(ok),
        errors=len(failed),
        cancelled=sum(1 for r in inside if r.error == "cancelled"),
        target_rate=target_rate,
        concurrency=concurrency,
        achieved_rate=achieved_rate([r.sent for r in records if r.sent and w0 <= r.sent < w1]),
        **flow,
        goodput=len(good) / span,
        slo_attainment=len(good) / len(ok) if ok else 0.0,
        slo_met=_slo_met(latency, ok, slo),
        **latency,
        cost_per_1m_output_tokens=cost_per_million(price_per_hour, flow["output_token_throughput"]),
        stopped_early=stopped_early,
        error_summary=_most_common_error(failed),
        limited_by=limited_by(target_rate is not None, lag, stopped_early, tolerance_ms),
        send_lag_ms=lag,
        cache_hit_rate=cache_hit_rate(ok),
    )


def cache_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens served from the prompt cache / prompt tokens, over the requests whose server said."""
    told = [r for r in records if r.cached_tokens is not None and r.input_tokens]
    total = sum(r.input_tokens or 0 for r in told)
    return sum(r.cached_tokens or 0 for r in told) / total if total else None


def _flow(records: Sequence[RequestRecord], window: tuple[float, float]) -> dict[str, float]:
    """Completions and output tokens per second, counted over the flow window (`flow_window`)."""
    f0, f1 = flow_window(records, window)
    flow_span = max(f1 - f0, 1e-9)
    completed = sum(1 for r in records if r.ok and r.done is not None and f0 <= r.done < f1)
    return {"request_throughput": completed / flow_span,
            "output_token_throughput": sum(_tokens_in(r, f0, f1) for r in records) / flow_span}


def _latencies(inside: list[RequestRecord], ok: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """Mean and percentiles (ms) of the requests that completed; queue time of every one sent."""
    return {
        "ttft_ms": describe_ms([r.ttft for r in ok]),
        "tpot_ms": describe_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": describe_ms([x for r in ok for x in r.itl]),
        "e2e_ms": describe_ms([r.e2e for r in ok]),
        "queue_ms": describe_ms([r.queue_time for r in inside if r.sent]),
    }


def _within_slo(ok: list[RequestRecord], slo: SLO) -> list[RequestRecord]:
    """The requests that met the SLO on both TTFT and TPOT: what goodput counts."""
    return [r for r in ok if r.ttft * 1000 <= slo.ttft_p95_ms and (r.tpot is None or r.tpot * 1000 <= slo.tpot_p95_ms)]


def _slo_met(latency: Mapping[str, Mapping[str, float]], ok: list[RequestRecord], slo: SLO) -> bool:
    """The stage's p95 TTFT and TPOT (when any request had one) within the SLO."""
    has_tpot = any(r.tpot is not None for r in ok)
    return (
        bool(ok)
        and latency["ttft_ms"]["p95"] <= slo.ttft_p95_ms
        and (not has_tpot or latency["tpot_ms"]["p95"] <= slo.tpot_p95_ms)
    )


def achieved_rate(sent: Sequence[float]) -> float:
    """Requests per second actually sent: (n - 1) / (last - first) send time.

    Counting sends in a window is off by up to one request per window (2% of a 50-request
    window); the spacing of the sends themselves is not.
    """
    if len(sent) < 2:
        return float("nan")
    return (len(sent) - 1) / (max(sent) - min(sent))


def send_lag_ms(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Actual send - scheduled send, in ms: p50, p99, max. A request whose bytes never went out
    counts as late as when it was given up (a lower bound on its lag)."""
    lags = [(r.sent or r.done) - r.scheduled for r in records if r.sent or r.done is not None]
    if not lags:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    a = np.asarray(lags, dtype=float) * 1000
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def limited_by(
    open_loop: bool, lag_ms: Mapping[str, float], stopped_early: str | None, tolerance_ms: float
) -> str | None:
    """Who set the pace of an open-loop stage: "server" when it stopped because requests in flight
    kept growing while sends were on time, "client" when it stopped because sends fell behind or
    (not stopped so) its p99 lag is over `tolerance_ms`, else None. Closed loop: None (it sends when
    free). The stop's verdict comes first: it judged where the client stood as the queue grew, and
    a stall the client caught up from lifts the p99 of a short stage without making it the limit."""
    if not open_loop:
        return None
    reason = stopped_early or ""
    if reason.startswith(OVER_SATURATED):
        return SERVER
    if reason.startswith(CLIENT_LIMITED) or lag_ms.get("p99", 0.0) > tolerance_ms:
        return CLIENT
    return None


def client_limited(summary: Summary | Mapping[str, Any]) -> bool:
    """True when a stage measured the client's limit, not the server's: never rank a candidate on it.

    Takes a `Summary` or its dict (a stage as result.json stores it)."""
    value = summary.get("limited_by") if isinstance(summary, Mapping) else summary.limited_by
    return value == CLIENT


def _most_common_error(failed: list[RequestRecord]) -> str | None:
    if not failed:
        return None
    text, n = collections.Counter(r.error for r in failed).most_common(1)[0]
    return f"{n}x {text}"


@dataclass
class Knee:
    rate: float
    label: str
    baseline_ms: float
    reason: str


def find_knee(summaries: Sequence[Summary], factor: float = 1.5, stat: str = "p50") -> Knee | None:
    """The highest open-loop rate before TTFT (`stat`) climbs past `factor` x its unloaded value.

    Queueing shows first in TTFT. The median is the default because one stall of a shared
    machine can move a short stage's p95 by itself; the tail is in the plots. The unloaded value
    is the synchronous stage's TTFT when there is one, else the lowest rate's. A stage that
    stopped early (over-saturated) is past the knee whatever its numbers. A client-limited stage
    is skipped: its load was not what was asked, so it says nothing about the server. None when
    there are fewer than two open-loop stages the client sent on time, or even the lowest rate is
    past the knee.
    """
    skipped = sum(1 for s in summaries if s.target_rate and client_limited(s))
    open_loop = sorted((s for s in summaries if s.target_rate and not client_limited(s)), key=lambda s: s.target_rate)
    if len(open_loop) < 2:
        return None
    unloaded = [s.ttft_ms[stat] for s in summaries if s.concurrency == 1 and s.completed]
    baseline = min(unloaded) if unloaded else open_loop[0].ttft_ms[stat]
    knee = None
    for s in open_loop:
        if s.stopped_early or not s.completed or not s.ttft_ms[stat] <= factor * baseline:
            why = s.stopped_early or f"TTFT {stat} {s.ttft_ms[stat]:.0f} ms > {factor:g} x {baseline:.0f} ms"
            return (
                Knee(knee.target_rate, knee.label, baseline, f"next rate {s.target_rate:.3g}/s: {why}")
                if knee
                else None
            )
        knee = s
    assert knee is not None
    tried = "the highest rate tried"
    if skipped:
        tried = f"the highest rate sent on time ({skipped} client-limited stage(s) skipped)"
    return Knee(knee.target_rate or 0.0, knee.label, baseline, f"latency stayed flat up to {tried}")
