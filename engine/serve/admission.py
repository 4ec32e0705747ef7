"""Serving-side admission control as aiohttp middleware, shared by `kiln serve` and `kiln route`.

What it does, per request on the guarded paths (the two OpenAI generation endpoints):
- drain: once draining (SIGTERM), new requests get a fast 503 and /health says so, while
  requests already admitted run to the end of their stream;
- per-tenant rate limit: a token bucket per API key (tenants are told apart by a hash of the key,
  never the key itself); over the limit, 429 with the Retry-After that refills one token;
- bounded queue: at most `max_concurrency` requests run, and one more waits only when its
  estimated wait fits the queue budget (and at most `max_queue` wait); otherwise an immediate 429
  whose Retry-After is that estimate, instead of a timeout minutes later;
- one JSON log line per request on the `kiln.requests` logger, refused ones included: queue time,
  TTFT, TPOT, tokens in/out, status, tenant, plus whatever the handler put in `request[STATS]`
  (a refusal carries its `reason`; a client that left mid-request is logged as status 499).

The queue rule (`kiln serve`'s defaults; docs/serving.md has the measurements). A request that
waits for a slot waits until the slot it is in line for frees: each request holds its slot for
`hold` seconds on average (measured over the last requests that succeeded), so a running request
frees its slot `hold` after it got it, and the k-th in line takes the k-th slot to free (one more
`hold` per full round of slots). Under overload the queue stays full, so every admitted request waits as long as the
queue allows: a queue bounded in *time*, not count, bounds that wait. The budget is half the
median time from slot to first token (what a request sees at capacity, without queueing), so
admitted requests' TTFT stays within 1.5x of its at-capacity value however heavy the overload;
with a TTFT objective (`ttft_slo_ms`) the budget is what the objective leaves after the p90 of
that time. Slots default to the engine's batch size: a request admitted beyond it would wait
inside the engine, unseen by the budget.

Adopt it in a server with `admission = Admission(config)`, `web.Application(middlewares=
[admission.middleware])`, and serve with `serve_until_drained(...)`, which turns SIGTERM into a
drain. Handlers report what they measured by filling `request[STATS]` (a dict: `ttft_ms` from
`request[ARRIVAL]`, when the request reached the middleware, `time.perf_counter()`).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import signal
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.serve import metric_names as names
from kiln.core.errors import BadInput


class AdmissionConfig(BaseModel):
    """Serving-side protection, shared by `kiln route` and `kiln serve`."""

    model_config = ConfigDict(extra="forbid")

    max_concurrency: int | None = Field(256, ge=1, description="requests handled at once; None = the engine's "
                                        "max_batch_size (kiln serve)")
    max_queue: int | None = Field(1024, ge=0, description="most requests waiting for a slot; None = as many as "
                                  "max_concurrency")
    max_queue_wait_s: float | Literal["auto"] | None = Field(
        None, description="queue a request only if its estimated wait fits: seconds, 'auto' (half the median "
                          "time from slot to first token, or what ttft_slo_ms leaves), or None (max_queue alone)")
    ttft_slo_ms: float | None = Field(None, gt=0, description="TTFT objective: with max_queue_wait_s 'auto', the "
                                      "queue budget is this less the p90 time from slot to first token")
    queue_timeout_s: float = Field(60, gt=0, description="longest wait in the queue before a 429")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After of a 429 from a full queue before any "
                                 "request has finished (later: the estimated wait)")
    rate_limit_rps: float | None = Field(None, gt=0, description="per-tenant (API key) requests/s; None = off")
    rate_limit_burst: int = Field(20, ge=1, description="token-bucket size per tenant")
    drain_timeout_s: float = Field(30, ge=0, description="on SIGTERM: longest wait for in-flight requests")
    log_requests: bool = Field(True, description="one JSON line per request on the 'kiln.requests' logger")


# `kiln serve`'s defaults: slots = the engine's batch, a queue bounded by time (see above).
SERVE_ADMISSION = AdmissionConfig(max_concurrency=None, max_queue=None, max_queue_wait_s="auto")
UNSIZED_SLOTS = 32  # slots when max_concurrency is None and no engine batch size is known
QUEUE_SHARE = 0.5  # the 'auto' budget as a share of the median slot-to-first-token time: TTFT <= 1.5x
MIN_SAMPLES = 4  # finished requests before the estimates are trusted


class SlotClock:
    """What admitted requests measured, over the last `window` that succeeded: how long each held
    its slot, and how long from its slot to its first token."""

    def __init__(self, window: int = 64):
        self.hold: deque[float] = deque(maxlen=window)
        self.first: deque[float] = deque(maxlen=window)

    def record(self, hold_s: float, first_s: float | None) -> None:
        self.hold.append(hold_s)
        if first_s is not None:
            self.first.append(max(0.0, first_s))

    def wait(self, position: int, slots: int, started: list[float], now: float) -> float | None:
        """Seconds until the `position`-th waiting request gets a slot, given when the running
        requests got theirs (`started`); None before MIN_SAMPLES. Each running request is
        expected to hold its slot for the mean hold; the k-th waiting takes the k-th slot to free,
        and every full round of slots beyond that costs one more hold."""
        if len(self.hold) < MIN_SAMPLES:
            return None
        hold = statistics.fmean(self.hold)
        frees = sorted(max(0.0, hold - (now - t)) for t in started)
        frees += [0.0] * (slots - len(frees))  # a slot not taken frees at once
        rounds, k = divmod(position - 1, slots)
        return frees[k] + rounds * hold

    def first_token(self, percentile: int) -> float | None:
        if len(self.first) < MIN_SAMPLES:
            return None
        return statistics.quantiles(self.first, n=100, method="inclusive")[percentile - 1]


GUARDED = ("/v1/completions", "/v1/chat/completions")
STATS = web.RequestKey("kiln.stats", dict)  # handlers add ttft_ms, tpot_ms, tokens_in, tokens_out, ...
ARRIVAL = web.RequestKey("kiln.arrival", float)  # time.perf_counter() when the request arrived
log = logging.getLogger("kiln.requests")


def bearer_key(authorization: str) -> bytes:
    """The credentials of `Authorization: Bearer KEY` (b"" if none); the scheme is
    case-insensitive (RFC 7235), so `bearer KEY` is the same key."""
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip().encode() if scheme.lower() == "bearer" else b""


def key_matches(authorization: str, keys: list[bytes]) -> bool:
    """Whether the request's bearer key is one of `keys`: constant-time, every key compared."""
    sent = bearer_key(authorization)
    return bool(sent) and any([hmac.compare_digest(sent, key) for key in keys])


def api_keys(value: str | None, source: str = "api_key") -> list[bytes]:
    """The keys a server accepts: `value` split at commas (one per tenant); None: no key.

    A value that is set but strips to no key at all, or to an empty one (" ", ",", "a,,"), is
    refused: a server keeps no empty key, so it would have announced a key and served open.
    `source` names where the value came from, for the message; the value itself is never shown."""
    if value is None:
        return []
    keys = [k.strip() for k in value.split(",")]
    if not all(keys):
        raise BadInput(f"{source}: holds an empty API key (blank, or an empty item between commas); a server keeps "
                       f"no empty key, so with none left it would serve anyone. Set {source} to a key (several "
                       f"tenants: comma-separated keys, none empty), or leave it unset for no key.")
    return [k.encode() for k in keys]


def tenant_of(request: web.Request) -> str:
    """A stable tenant id: a short hash of the bearer key, else the peer address."""
    if key := bearer_key(request.headers.get("Authorization", "")):
        return "key:" + hashlib.sha256(key).hexdigest()[:12]
    return f"ip:{request.remote or 'unknown'}"


class TokenBucket:
    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()

    def take(self) -> float:
        """0 when a token was taken, else the seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


def _reject(status: int, message: str, retry_after: float, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))}
    if status == 503:
        headers["Connection"] = "close"
    return web.json_response(body, status=status, headers=headers)


class Admission:
    """Bounded queue, per-tenant rate limits, drain and request logs for one server."""

    def __init__(self, config: AdmissionConfig, paths: tuple[str, ...] = GUARDED):
        self.config, self.paths = config, paths
        self.slots = self.queue_cap = 0
        self.size(None)
        self.running = 0  # admitted and not finished
        self.waiting = 0
        self.rejected: dict[str, int] = {"queue_full": 0, "rate_limited": 0, "draining": 0, "queue_timeout": 0}
        self.draining = False
        self.clock = SlotClock()
        self._started: dict[int, float] = {}  # running request -> when it got its slot
        self._slots: asyncio.Semaphore | None = None
        self._idle: asyncio.Event | None = None
        self._cut: asyncio.Event | None = None
        self._buckets: dict[str, TokenBucket] = {}
        self._requests: Counter | None = None

    def size(self, batch: int | None) -> None:
        """Resolve the unset bounds against the engine's batch size (before the first request)."""
        self.slots = self.config.max_concurrency or batch or UNSIZED_SLOTS
        self.queue_cap = self.slots if self.config.max_queue is None else self.config.max_queue

    def budget(self) -> float | None:
        """Longest estimated wait a request may queue for (None: no time bound, or not measured yet)."""
        cfg = self.config
        if cfg.max_queue_wait_s != "auto":
            return cfg.max_queue_wait_s
        if cfg.ttft_slo_ms is not None:
            p90 = self.clock.first_token(90)
            return None if p90 is None else max(0.0, cfg.ttft_slo_ms / 1000 - p90)
        p50 = self.clock.first_token(50)
        return None if p50 is None else QUEUE_SHARE * p50

    def estimated_wait(self, position: int | None = None) -> float | None:
        """How long the `position`-th in line (default: a request arriving now) would wait for a
        slot; None: not measured yet."""
        if position is None and (self._slots is None or not self._slots.locked()):
            return 0.0
        return self.clock.wait(position or self.waiting + 1, self.slots, list(self._started.values()),
                               time.perf_counter())

    def _refuse(self, request: web.Request, tenant: str, reason: str, status: int, message: str,
                retry_after: float, wait: float | None = None) -> web.Response:
        self.rejected[reason] += 1
        self.count(status)
        if self.config.log_requests:
            extra = {} if wait is None else {"estimated_wait_s": wait}
            self._log(request, tenant, status, request[ARRIVAL], {"reason": reason, **extra})
        return _reject(status, message, retry_after, "overloaded" if status == 429 else "unavailable")

    def _queue_refusal(self) -> tuple[str, float, float | None] | None:
        """Why a request that found every slot taken may not wait (message, Retry-After, estimated
        wait), or None."""
        wait = self.estimated_wait(self.waiting + 1)
        retry_after = self.config.retry_after_s if wait is None else round(wait)  # an estimate: nearest second
        if self.waiting >= self.queue_cap:
            return f"queue full ({self.waiting} waiting for {self.slots} slots)", retry_after, wait
        budget = self.budget()
        if wait is not None and budget is not None and wait > budget:
            return (f"at capacity: {self.slots} running, {self.waiting} waiting; a slot would take ~{wait:.2f} s, "
                    f"over the queue budget of {budget:.2f} s", retry_after, wait)
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path not in self.paths:
            return await handler(request)
        request[ARRIVAL] = arrival = time.perf_counter()
        if self._slots is None:  # created on the serving loop
            self._slots, self._idle = asyncio.Semaphore(self.slots), asyncio.Event()
        tenant = tenant_of(request)
        refusal = self._refuse_at_once(request, tenant)
        if refusal is None:
            refusal, estimate = await self._take_slot(request, tenant)
        if refusal is not None:
            return refusal
        return await self._serve(request, handler, tenant, arrival, estimate)

    def _refuse_at_once(self, request: web.Request, tenant: str) -> web.Response | None:
        """The refusals that need no slot to judge: a draining server, a tenant over its rate limit."""
        cfg = self.config
        if self.draining:
            return self._refuse(request, tenant, "draining", 503,
                                "server is draining (shutting down); retry on another replica", 1)
        if cfg.rate_limit_rps:
            bucket = self._buckets.setdefault(tenant, TokenBucket(cfg.rate_limit_rps, cfg.rate_limit_burst))
            if wait := bucket.take():
                return self._refuse(request, tenant, "rate_limited", 429,
                                    f"rate limit of {cfg.rate_limit_rps:g} requests/s exceeded", wait)
        return None

    async def _take_slot(self, request: web.Request, tenant: str) -> tuple[web.Response | None, float | None]:
        """A running slot, at once or after a wait in the queue: (None, the wait it was told to expect, None
        when it did not queue), or (the refusal, None) when the queue is full, over budget or timed out."""
        cfg = self.config
        if not self._slots.locked():
            await self._slots.acquire()  # a free slot: returns at once, no other request can slip in
            return None, None
        if refusal := self._queue_refusal():
            message, retry_after, wait = refusal
            return self._refuse(request, tenant, "queue_full", 429, message, retry_after, wait), None
        estimate = self.estimated_wait(self.waiting + 1)
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), cfg.queue_timeout_s)
        except TimeoutError:
            return self._refuse(request, tenant, "queue_timeout", 429,
                                f"waited {cfg.queue_timeout_s:g} s for a slot", cfg.retry_after_s), None
        finally:
            self.waiting -= 1
        return None, estimate

    async def _serve(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                     tenant: str, arrival: float, estimate: float | None) -> web.StreamResponse:
        """Run an admitted request in its slot; then free the slot and record its time and outcome."""
        cfg = self.config
        self.running += 1
        self._idle.clear()  # type: ignore[union-attr]
        admitted = time.perf_counter()
        self._started[id(request)] = admitted
        request[STATS] = stats = {"queue_ms": (admitted - arrival) * 1000}
        if estimate is not None:  # what it was told to expect, beside what it waited (queue_ms)
            stats["estimated_wait_s"] = estimate
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self._slots.release()
            del self._started[id(request)]
            self.running -= 1
            if self.running == 0:
                self._idle.set()  # type: ignore[union-attr]
            if status == 200 and "error" not in stats:
                ttft = stats.get("ttft_ms")
                self.clock.record(time.perf_counter() - admitted,
                                  None if ttft is None else ttft / 1000 - (admitted - arrival))
            self.count(status, stats.get("error"))
            if cfg.log_requests:
                self._log(request, tenant, status, arrival, stats)

    def count(self, status: int, stream_error: str | None = None) -> None:
        """Count one finished request by outcome (also those refused before admission: 401, 503)."""
        if self._requests is not None:
            failed = stream_error is not None and not stream_error.startswith("invalid_request_error")
            self._requests.labels(names.outcome(status, failed)).inc()

    def _log(self, request: web.Request, tenant: str, status: int, arrival: float, stats: dict[str, Any]) -> None:
        line = {"ts": round(time.time(), 3), "method": request.method, "path": request.path, "status": status,
                "tenant": tenant, "e2e_ms": round((time.perf_counter() - arrival) * 1000, 3)}
        line.update({k: round(v, 3) if isinstance(v, float) else v for k, v in stats.items()})
        for key in ("queue_ms", "ttft_ms", "tpot_ms", "tokens_in", "tokens_out"):
            line.setdefault(key, None)
        log.info(json.dumps(line, separators=(",", ":")))

    def start_drain(self) -> None:
        self.draining = True

    async def until_cut(self) -> None:
        """Returns when the drain timed out: a handler still answering then ends its answer
        (a final error event on a stream, a 503 otherwise) instead of being dropped mid-way."""
        if self._cut is None:
            self._cut = asyncio.Event()
        await self._cut.wait()

    def cut(self) -> None:
        if self._cut is None:
            self._cut = asyncio.Event()
        self._cut.set()

    async def drain(self) -> bool:
        """What SIGTERM does: refuse new requests, wait up to drain_timeout_s for the admitted ones.
        True when they all finished."""
        self.start_drain()
        return await self.wait_idle(self.config.drain_timeout_s)

    def export(self, registry: CollectorRegistry, prefix: str, count_requests: bool = False) -> None:
        """Queue depth, requests running and refusals by reason as gauges read at scrape time;
        `count_requests`: also every guarded request by outcome (metric_names.REQUESTS)."""
        if count_requests:
            self._requests = Counter(names.REQUESTS, "requests finished, by outcome (success, client_error, "
                                     "server_error, rejected)", [names.OUTCOME], registry=registry)
            for o in names.OUTCOMES:  # every series exists from the start: a rate of 0 is not 'no data'
                self._requests.labels(o)
        Gauge(f"{prefix}_queue_depth", "requests waiting for an admission slot", registry=registry).set_function(
            lambda: self.waiting)
        Gauge(f"{prefix}_running", "requests admitted and not finished", registry=registry).set_function(
            lambda: self.running)
        Gauge(f"{prefix}_slots", "requests that may run at once", registry=registry).set_function(lambda: self.slots)
        Gauge(f"{prefix}_estimated_wait_seconds", "how long a request arriving now would wait for a slot (NaN "
              "before enough requests finished)", registry=registry).set_function(
            lambda: math.nan if (w := self.estimated_wait()) is None else w)
        Gauge(f"{prefix}_queue_budget_seconds", "longest estimated wait a request may queue for (NaN: no time "
              "bound or not measured yet)", registry=registry).set_function(
            lambda: math.nan if (b := self.budget()) is None else b)
        refused = Gauge(f"{prefix}_rejected", "requests refused so far, by reason", ["reason"], registry=registry)
        for reason in self.rejected:
            refused.labels(reason).set_function(lambda r=reason: self.rejected[r])

    async def wait_idle(self, timeout: float) -> bool:
        """True when every admitted request finished within `timeout` seconds."""
        if self.running == 0 and self.waiting == 0:
            return True
        deadline = time.monotonic() + timeout
        while (self.running or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not (self.running or self.waiting)

    def health(self) -> tuple[int, dict[str, Any]]:
        """Status and body for /health: 503 while draining so a load balancer stops sending."""
        if self.draining:
            return 503, {"status": "draining", "running": self.running}
        return 200, {"status": "ok", "running": self.running, "waiting": self.waiting}


def log_requests_to(target: str) -> None:
    """Send the `kiln.requests` and `kiln.serve` JSON lines to 'stderr', 'stdout' or a file (appended)."""
    streams = {"stderr": sys.stderr, "stdout": sys.stdout}
    try:
        handler = logging.StreamHandler(streams[target]) if target in streams else logging.FileHandler(target)
    except OSError as e:
        raise BadInput(f"request log: cannot open {target} ({e.strerror}); give a writable file, "
                       "'stdout' or 'stderr'.") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("kiln.requests", "kiln.serve"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)


CUT_AFTER_DRAIN_S = 0.25  # how long handlers still running after the drain timeout get to end their answers


class DrainCut(Exception):
    """Raised in a handler whose answer the drain timeout cut short."""


async def serve_until_drained(app: web.Application, admission: Admission, host: str, port: int,
                              on_ready: Callable[[int], None] | None = None,
                              handler_cancellation: bool = False, sock: socket.socket | None = None) -> None:
    """Serve `app` until SIGTERM or SIGINT, then drain: refuse new requests, let in-flight streams
    finish (up to drain_timeout_s), stop. Call inside a running loop (uvloop.run).
    `handler_cancellation`: cancel a handler whose client disconnected (aiohttp's option).
    `sock`: a listening socket to serve on instead of binding host:port (one a parent holds, so
    connections wait in its backlog while a crashed server is replaced)."""
    # aiohttp's cleanup waits shutdown_timeout (60 s by default) for handlers still running after
    # the drain: that made a --drain-timeout 2 exit after 57 s. A quarter second, then they are cancelled.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=handler_cancellation,
                           shutdown_timeout=CUT_AFTER_DRAIN_S)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready:
        on_ready(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    try:
        await stop.wait()
        drained = await admission.drain()
        logging.getLogger("kiln.serve").info(json.dumps({"event": "drained", "clean": drained}))
        if not drained:
            admission.cut()  # handlers still running end their answers now, within CUT_AFTER_DRAIN_S
            await admission.wait_idle(CUT_AFTER_DRAIN_S)
    finally:
        await runner.cleanup()
