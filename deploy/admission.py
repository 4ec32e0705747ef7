"""Serving-side admission control as aiohttp middleware, for the router and for `kiln serve`.

What it does, per request on the guarded paths (the two OpenAI generation endpoints):
- drain: once draining (SIGTERM), new requests get a fast 503 and /health says so, while
  requests already admitted run to the end of their stream;
- per-tenant rate limit: a token bucket per API key (tenants are told apart by a hash of the key,
  never the key itself); over the limit, 429 with the Retry-After that refills one token;
- bounded queue: at most `max_concurrency` requests run, at most `max_queue` wait; when the queue
  is full the answer is an immediate 429 with Retry-After instead of a timeout minutes later;
- one JSON log line per request on the `kiln.requests` logger, refused ones included: queue time,
  TTFT, TPOT, tokens in/out, status, tenant, plus whatever the handler put in `request[STATS]`
  (a refusal carries its `reason`; a client that left mid-request is logged as status 499).

Adopt it in a server with `admission = Admission(config)`, `web.Application(middlewares=
[admission.middleware])`, and serve with `serve_until_drained(...)`, which turns SIGTERM into a
drain. Handlers report what they measured by filling `request[STATS]` (a dict), timing from
`request[ARRIVAL]` (when the request reached the middleware, `time.perf_counter()`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kiln.deploy.config import AdmissionConfig
from kiln.engine import metric_names as names
from kiln.pipeline.errors import BadInput

GUARDED = ("/v1/completions", "/v1/chat/completions")
STATS = web.RequestKey("kiln.stats", dict)  # handlers add ttft_ms, tpot_ms, tokens_in, tokens_out, ...
ARRIVAL = web.RequestKey("kiln.arrival", float)  # time.perf_counter() when the request arrived
log = logging.getLogger("kiln.requests")


def tenant_of(request: web.Request) -> str:
    """A stable tenant id: a short hash of the bearer key, else the peer address."""
    scheme, _, key = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() == "bearer" and key.strip():  # the scheme is case-insensitive (RFC 7235)
        return "key:" + hashlib.sha256(key.strip().encode()).hexdigest()[:12]
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
        self.running = 0  # admitted and not finished
        self.waiting = 0
        self.rejected: dict[str, int] = {"queue_full": 0, "rate_limited": 0, "draining": 0, "queue_timeout": 0}
        self.draining = False
        self._slots: asyncio.Semaphore | None = None
        self._idle: asyncio.Event | None = None
        self._buckets: dict[str, TokenBucket] = {}
        self._requests: Counter | None = None

    def _refuse(self, request: web.Request, tenant: str, reason: str, status: int, message: str,
                retry_after: float) -> web.Response:
        self.rejected[reason] += 1
        self._count(status)
        if self.config.log_requests:
            self._log(request, tenant, status, request[ARRIVAL], {"reason": reason})
        return _reject(status, message, retry_after, "overloaded" if status == 429 else "unavailable")

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.path not in self.paths:
            return await handler(request)
        cfg = self.config
        request[ARRIVAL] = arrival = time.perf_counter()
        if self._slots is None:  # created on the serving loop
            self._slots, self._idle = asyncio.Semaphore(cfg.max_concurrency), asyncio.Event()
        tenant = tenant_of(request)
        if self.draining:
            return self._refuse(request, tenant, "draining", 503,
                                "server is draining (shutting down); retry on another replica", 1)
        if cfg.rate_limit_rps:
            bucket = self._buckets.setdefault(tenant, TokenBucket(cfg.rate_limit_rps, cfg.rate_limit_burst))
            if wait := bucket.take():
                return self._refuse(request, tenant, "rate_limited", 429,
                                    f"rate limit of {cfg.rate_limit_rps:g} requests/s exceeded", wait)
        if not self._slots.locked():
            await self._slots.acquire()  # a free slot: returns at once, no other request can slip in
        elif self.waiting >= cfg.max_queue:
            return self._refuse(request, tenant, "queue_full", 429, f"queue full ({cfg.max_queue} waiting)",
                                cfg.retry_after_s)
        else:
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), cfg.queue_timeout_s)
            except TimeoutError:
                return self._refuse(request, tenant, "queue_timeout", 429,
                                    f"waited {cfg.queue_timeout_s:g} s for a slot", cfg.retry_after_s)
            finally:
                self.waiting -= 1
        self.running += 1
        self._idle.clear()  # type: ignore[union-attr]
        request[STATS] = stats = {"queue_ms": (time.perf_counter() - arrival) * 1000}
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
            self.running -= 1
            if self.running == 0:
                self._idle.set()  # type: ignore[union-attr]
            self._count(status, stats.get("error"))
            if cfg.log_requests:
                self._log(request, tenant, status, arrival, stats)

    def _count(self, status: int, stream_error: str | None = None) -> None:
        if self._requests is not None and status != 499:  # 499: the client left, nothing was answered
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


CUT_AFTER_DRAIN_S = 0.25  # how long handlers still running after the drain timeout get before cancellation


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
    finally:
        await runner.cleanup()
