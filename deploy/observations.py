"""What the router saw, per arm: Prometheus series for dashboards and a window of per-request
observations for the canary controller.

Prometheus histograms are fine for dashboards but lose the individual requests a sequential test
needs, so the router also keeps the last `window` requests (TTFT, TPOT, error) in memory, each
with a sequence number; the controller reads them incrementally (`GET /admin/observations?since=N`)
and never sees a request twice. Mirrored comparisons (the same greedy request answered by both
arms, scored as the offline served-text check scores a pair) go to a second window.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kiln.engine.serve import metric_names as names

# Seconds, from a few ms (fakes, small models) to minutes (long generations).
BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 60, 120)
# Agreement scores (served_prefix, a fraction); the AnalysisTemplates read the means (_sum / _count).
AGREEMENT_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


@dataclass(slots=True)
class Observation:
    """One attempt of one request on one arm. `error` is None when the arm answered in full."""

    seq: int
    t: float  # wall clock at the end
    arm: str
    status: int
    error: str | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    tokens_out: int
    retried: bool = False  # a failed canary attempt that stable then served


@dataclass(slots=True)
class Comparison:
    """A mirrored greedy prompt, answered by stable twice and by the canary once (one of the three
    is the client's answer). The canary's answer and stable's second are each scored against
    stable's first as the offline served-text check scores a pair (served_scores, on the text):
    the canary's agreement with stable, and the noise floor, stable's agreement with itself."""

    seq: int
    t: float
    primary: str  # the arm whose answer the client got
    prefix: float  # served_prefix: leading characters shared, as a fraction of the longer answer
    match: float  # served_match: 1.0 when the two answers are identical
    floor_prefix: float  # the same two scores for stable's second answer
    floor_match: float


class Window:
    """A bounded log with sequence numbers, read incrementally."""

    def __init__(self, size: int):
        self.items: collections.deque = collections.deque(maxlen=size)
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        return next(self._seq)

    def since(self, seq: int, limit: int = 100_000) -> list[Any]:
        out = []
        for item in reversed(self.items):  # newest first; stop at what the reader already has
            if item.seq <= seq:
                break
            out.append(item)
        return [asdict(x) for x in reversed(out[-limit:] if len(out) > limit else out)]


class ArmMetrics:
    """Per-arm Prometheus series of the router (label arm="stable"|"canary")."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        arm = [names.ARM]
        self.requests = Counter(names.ROUTER_REQUESTS, "request attempts", [names.ARM, names.OUTCOME], registry=r)
        self.retries = Counter(names.ROUTER_RETRIES, "canary failures served by stable instead", registry=r)
        self.ttft = Histogram(names.ROUTER_TTFT, "time to first token", arm, buckets=BUCKETS, registry=r)
        self.tpot = Histogram(names.ROUTER_TPOT, "mean time per output token after the first", arm, buckets=BUCKETS,
                              registry=r)
        self.e2e = Histogram(names.ROUTER_E2E, "request latency, end to end", arm, buckets=BUCKETS, registry=r)
        self.in_flight = Gauge(names.ROUTER_IN_FLIGHT, "requests in flight", arm, registry=r)
        self.weight = Gauge(names.ROUTER_WEIGHT, "canary traffic weight", registry=r)
        pair = [names.PAIR]
        self.mirror_prefix = Histogram(names.ROUTER_MIRROR_PREFIX, "served_prefix of a mirrored prompt's answer",
                                       pair, buckets=AGREEMENT_BUCKETS, registry=r)
        self.mirror_match = Histogram(names.ROUTER_MIRROR_MATCH, "served_match of a mirrored prompt's answer",
                                      pair, buckets=(0.5, 1.0), registry=r)
        for p in (names.MIRROR_CANARY, names.MIRROR_FLOOR):  # exported from the start: rate() needs a first sample
            self.mirror_prefix.labels(p)
            self.mirror_match.labels(p)
        self.mirror_dropped = Counter(names.ROUTER_MIRROR_DROPPED, "mirrors not compared", [names.REASON], registry=r)
        for reason in (names.MIRROR_LOAD, names.MIRROR_FAILED):
            self.mirror_dropped.labels(reason)

    def record(self, obs: Observation) -> None:
        outcome = (names.SUCCESS if obs.error is None else names.SERVER_ERROR if is_failure(obs.status, obs.error)
                   else names.CLIENT_ERROR)
        self.requests.labels(obs.arm, outcome).inc()
        if obs.error is None:
            self.e2e.labels(obs.arm).observe(obs.e2e_s)
            if obs.ttft_s is not None:
                self.ttft.labels(obs.arm).observe(obs.ttft_s)
            if obs.tpot_s is not None:
                self.tpot.labels(obs.arm).observe(obs.tpot_s)


    def record_mirror(self, c: Comparison) -> None:
        for pair, prefix, match in ((names.MIRROR_CANARY, c.prefix, c.match),
                                    (names.MIRROR_FLOOR, c.floor_prefix, c.floor_match)):
            self.mirror_prefix.labels(pair).observe(prefix)
            self.mirror_match.labels(pair).observe(match)


def is_failure(status: int, error: str | None) -> bool:
    """An arm failure: no answer, a 5xx or a 429. A 4xx is the client's mistake, not the arm's."""
    return error is not None and not (400 <= status < 500 and status != 429)
