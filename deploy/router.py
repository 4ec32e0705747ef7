"""`kiln route`: one OpenAI-compatible entry point in front of a stable and a canary backend.

- Splits traffic by a canary weight (percent) that can change at runtime (POST /admin/weight),
  sticky per session (X-Session-Id header or the `user` field) or by prompt prefix on a
  consistent-hash ring (hashring.py), so prefix caches stay warm when the weight moves.
- An arm may be several replicas of one engine (its URL a comma-separated list). `balance: prefix`
  places each request on a replica by a hash of its prompt prefix (hashring.ReplicaRing, with a
  bound on load), so a replica's prompt cache sees the prefixes it already holds; `round-robin`
  takes them in turn. GET /admin/state shows each replica's requests.
- Streams pass through event by event. A canary that fails before its first token is retried on
  stable; one that dies mid-stream is continued on stable (sse.py): the client sees one stream.
- Records every attempt per arm: Prometheus series (/metrics) and a window of per-request
  observations the canary controller reads (GET /admin/observations?since=N).
- Optionally mirrors a fraction of greedy requests to the other arm and scores the answers as the
  offline served-text check does. Mirrors carry no client identity, start only with free slots,
  and are cancelled first when a client would wait (proxy.py).
- Admission control, rate limits, request logs and drain on SIGTERM come from engine/serve/admission.py
  (shared with `kiln serve`).

Keys: with a client key, /v1 needs `Authorization: Bearer <key>`. /admin always needs a key (it
moves traffic and points arms at new servers): the admin key if one is given, else the client key;
with neither, /admin answers 401 to everyone. /health and /metrics stay open. Backends get the
upstream key, never a client's credentials (proxy.py). Binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import Gauge, generate_latest

from kiln.deploy.config import RouterConfig
from kiln.deploy.hashring import ReplicaRing, WeightedRing
from kiln.deploy.observations import ArmMetrics, Window
from kiln.deploy.proxy import UPSTREAM_ERRORS, Backend, Proxy, error_response, upstream_key
from kiln.deploy.sse import prompt_prefix
from kiln.engine.serve import metric_names as names
from kiln.engine.serve.admission import Admission, api_keys
from kiln.engine.serve.auth import BearerAuth, Zone


ADMIN_CLOSED = ("This router has no admin key, so /admin is closed to everyone: start it with an admin key or a "
                "client key (`kiln route --help`: --admin-key-env, --api-key-env).")


def replica_urls(url: str) -> list[str]:
    """An arm's URL: one server, or its replicas comma-separated."""
    return [u.strip().rstrip("/") for u in url.split(",") if u.strip()]


class Replicas(Backend):
    """An arm's upstream: one server, or replicas of one engine sharing its requests (`cfg.balance`).
    `url` is the list as given, normalized: what identifies the arm's backend when it is swapped."""

    def __init__(self, url: str, cfg: RouterConfig):
        self.urls = replica_urls(url)
        super().__init__(",".join(self.urls), cfg)
        self.balance, self.prefix_chars, self.bound = cfg.balance, cfg.prefix_chars, cfg.balance_bound
        self.load = [0] * len(self.urls)  # requests in flight per replica
        self.sent = [0] * len(self.urls)
        self.ring = ReplicaRing(self.urls)
        self._turn = itertools.count()

    def pick(self, payload: dict[str, Any]) -> int:
        if len(self.urls) == 1:
            return 0
        if self.balance == "round-robin":
            return next(self._turn) % len(self.urls)
        return self.ring.pick(prompt_prefix(payload, self.prefix_chars), self.load, self.bound)

    @contextlib.asynccontextmanager
    async def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> AsyncIterator[Any]:
        k = self.pick(payload)
        self.load[k] += 1
        self.sent[k] += 1
        try:
            async with self.session.post(self.urls[k] + path, data=json.dumps(payload).encode(), headers=headers) as up:
                yield up
        finally:
            self.load[k] -= 1

    def state(self) -> dict[str, dict[str, int]]:
        return {url: {"in_flight": n, "sent": sent} for url, n, sent in zip(self.urls, self.load, self.sent, strict=True)}


class Router(Proxy):
    """The application: routes, auth, admin endpoints and the choice of arm; the request path
    itself (relay, failover, observations, mirroring) is in proxy.py."""

    def __init__(self, config: RouterConfig, api_key: str | None = None, upstream_api_key: str | None = None,
                 admin_key: str | None = None):
        """Keys: None for none; a blank one is BadInput. `api_key` may hold several (comma-separated)."""
        self.cfg, self.upstream_api_key = config, upstream_key(upstream_api_key)
        self.keys = api_keys(api_key, "api_key")
        self.admin_keys = api_keys(admin_key, "admin_key") or self.keys
        self.auth = BearerAuth([Zone("/admin/", self.admin_keys, closed=ADMIN_CLOSED), Zone("/v1/", self.keys)])
        self.ring = WeightedRing(config.vnodes, config.weight if config.canary_url else 0.0)
        self.backends: dict[str, Replicas] = {}  # type: ignore[assignment]  # Proxy's, each arm's replicas
        self.observations = Window(config.window)
        self.comparisons = Window(config.window)
        self.metrics = ArmMetrics()
        self.admission = Admission(config.admission)
        self._tasks: set[asyncio.Task] = set()
        self._mirrors: set[asyncio.Task] = set()
        self._retiring: list[Backend] = []
        Gauge(names.ROUTER_WAITING, "requests waiting for a slot", registry=self.metrics.registry).set_function(
            lambda: self.admission.waiting)
        self.metrics.weight.set(self.ring.weight)
        for arm in ("stable", "canary"):  # read at scrape time from the arm's current backend
            self.metrics.in_flight.labels(arm).set_function(
                lambda a=arm: self.backends[a].in_flight if a in self.backends else 0)

    # --- the application -------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth.middleware, self._shed_mirrors, self.admission.middleware],
                              client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/admin/state", self.state)
        app.router.add_post("/admin/weight", self.set_weight_handler)
        app.router.add_post("/admin/backends", self.set_backends_handler)
        app.router.add_get("/admin/observations", self.read_observations)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.set_backends(self.cfg.stable_url, self.cfg.canary_url)

    async def _stop(self, app: web.Application) -> None:
        for task in [*self._tasks, *self._mirrors]:
            task.cancel()
        for backend in [*self.backends.values(), *self._retiring]:
            await backend.session.close()

    @web.middleware
    async def _shed_mirrors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Mirrors are dropped first under load: a client that would wait for a slot cancels them."""
        a = self.admission
        if self._mirrors and request.path in a.paths and (a.waiting or a.running >= a.slots):
            self.drop_mirrors()
        return await handler(request)

    # --- control (also callable from Python in the router's loop) ----------------------------
    def set_weight(self, weight: float) -> None:
        if weight > 0 and "canary" not in self.backends:
            raise ValueError("no canary backend: set canary_url before giving the canary traffic")
        self.ring.set_weight(weight)
        self.metrics.weight.set(weight)

    def set_backends(self, stable_url: str, canary_url: str | None) -> None:
        """Point the arms at new servers; requests already running finish on the old ones."""
        for arm, url in (("stable", stable_url), ("canary", canary_url)):
            old = self.backends.get(arm)
            if old and old.url == ",".join(replica_urls(url or "")):
                continue
            if old:
                self._retiring.append(old)
                self._spawn(self._retire(old))
                del self.backends[arm]
            if url:
                self.backends[arm] = Replicas(url, self.cfg)
        if "canary" not in self.backends:
            self.set_weight(0)

    async def _retire(self, backend: Backend) -> None:
        await backend.retire()
        self._retiring.remove(backend)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def choose(self, request: web.Request, payload: dict[str, Any]) -> str:
        weight = self.ring.weight
        if weight <= 0 or "canary" not in self.backends:
            return "stable"
        if self.cfg.affinity == "random":
            return "canary" if random.random() * 100 < weight else "stable"
        key = None
        if self.cfg.affinity == "session":
            user = payload.get("user")
            key = request.headers.get(self.cfg.session_header) or (user if isinstance(user, str) and user else None)
        key = f"s:{key}" if key else "p:" + prompt_prefix(payload, self.cfg.prefix_chars)
        return self.ring.arm_for(key)

    # --- admin endpoints ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        status, body = self.admission.health()
        return web.json_response(body, status=status)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    async def state(self, request: web.Request) -> web.Response:
        a = self.admission
        return web.json_response({
            "weight": self.ring.weight, "canary_share": self.ring.canary_share(),
            "stable_url": self.backends["stable"].url if "stable" in self.backends else None,
            "canary_url": self.backends["canary"].url if "canary" in self.backends else None,
            "in_flight": {b.url: b.in_flight for b in [*self.backends.values(), *self._retiring]},
            "replicas": {arm: b.state() for arm, b in self.backends.items()},
            "retiring": [b.url for b in self._retiring],
            "admission": {"running": a.running, "waiting": a.waiting, "draining": a.draining, "rejected": a.rejected}})

    async def set_weight_handler(self, request: web.Request) -> web.Response:
        try:
            self.set_weight(float((await request.json())["weight"]))
        except (ValueError, KeyError, TypeError) as e:
            return error_response(400, f"POST /admin/weight wants {{\"weight\": 0-100}}: {e}", "invalid_request_error")
        return await self.state(request)

    async def set_backends_handler(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            self.set_backends(str(body["stable_url"]), body.get("canary_url"))
        except (ValueError, KeyError, TypeError) as e:
            return error_response(400, f"POST /admin/backends wants {{\"stable_url\": ..., \"canary_url\": ...}}: {e}",
                          "invalid_request_error")
        return await self.state(request)

    async def read_observations(self, request: web.Request) -> web.Response:
        try:
            since, mirror_since = int(request.query.get("since", 0)), int(request.query.get("mirror_since", 0))
        except ValueError:
            return error_response(400, "since and mirror_since must be integers (sequence numbers)", "invalid_request_error")
        obs, cmp = self.observations.since(since), self.comparisons.since(mirror_since)
        return web.json_response({"observations": obs, "comparisons": cmp,
                                  "next": obs[-1]["seq"] if obs else since,
                                  "next_mirror": cmp[-1]["seq"] if cmp else mirror_since})

    async def models(self, request: web.Request) -> web.Response:
        backend = self.backends["stable"]
        try:
            async with backend.session.get(backend.urls[0] + "/v1/models", headers=self._headers()) as up:
                return web.Response(body=await up.read(), status=up.status, content_type="application/json")
        except UPSTREAM_ERRORS as e:
            return error_response(502, f"stable backend unreachable: {type(e).__name__}")
