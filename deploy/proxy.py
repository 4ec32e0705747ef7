"""The router's request path: pick nothing, decide nothing, just carry one request to a backend
and back, with failover, measurement and mirroring (the Router in router.py decides the arm).

A canary attempt that fails before its first token is re-sent to stable; one that breaks
mid-stream is continued on stable (sse.continuation), so the client sees one clean stream. Every
attempt becomes an Observation for its arm (what the canary controller reads) and Prometheus
series. `Proxy` is a mixin of `Router`: it uses the router's backends, windows and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from kiln.deploy.config import RouterConfig
from kiln.deploy.observations import Comparison, Observation, is_failure
from kiln.deploy.sse import SSERelay, continuation, max_new_tokens
from kiln.engine.serve import metric_names as names
from kiln.engine.serve.admission import STATS, Admission, api_keys
from kiln.core.errors import BadInput
from kiln.evaluate.quality.served import served_scores

UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)
STARTED = web.RequestKey("kiln.started", web.StreamResponse)  # the client's stream, once its 200 is sent
MAX_MIRRORS_IN_FLIGHT = 64
# Request fields a mirror does not carry: the client's identity (OpenAI's `user`, `metadata`,
# `safety_identifier`, `prompt_cache_key`) and the streaming options (a mirror reads one JSON body).
MIRROR_DROPS = ("user", "metadata", "safety_identifier", "prompt_cache_key", "stream", "stream_options")


def error_response(status: int, message: str, kind: str = "router_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def upstream_key(value: str | None) -> str | None:
    """The one key the router sends its backends (None: it sends none); blank or several is BadInput."""
    keys = api_keys(value, "upstream_api_key")
    if len(keys) > 1:
        raise BadInput("upstream_api_key: holds several comma-separated keys; the router sends its backends one.")
    return keys[0].decode() if keys else None


class Backend:
    """One upstream server and the pooled connections to it."""

    def __init__(self, url: str, cfg: RouterConfig):
        self.url = url.rstrip("/")
        self.in_flight = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)

    def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> Any:
        return self.session.post(self.url + path, data=json.dumps(payload).encode(), headers=headers)

    async def retire(self) -> None:
        """Close once the requests still using this backend are done (after a swap)."""
        while self.in_flight:
            await asyncio.sleep(0.05)
        await self.session.close()


class Proxy:
    """Request handling for Router (see router.py for the attributes it relies on)."""

    cfg: RouterConfig
    upstream_api_key: str | None
    backends: dict[str, Backend]
    admission: Admission
    _mirrors: set[asyncio.Task]


    def _headers(self) -> dict[str, str]:
        """What every upstream request carries: the router's own upstream key, if it has one, and never
        the client's Authorization (a client's key is for this router; a backend that logs or is run
        by someone else must not learn it, and a backend that shares it must not be opened by it)."""
        headers = {"Content-Type": "application/json"}
        if self.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.upstream_api_key}"
        return headers

    def _record(self, arm: str, status: int, error: str | None, start: float, relay: SSERelay | None,
                retried: bool = False) -> None:
        ttft = tpot = None
        if relay is not None and relay.attempt_first is not None and error is None:
            ttft = relay.attempt_first - start
            if relay.attempt_tokens > 1 and relay.last is not None:
                tpot = (relay.last - relay.attempt_first) / (relay.attempt_tokens - 1)
        obs = Observation(self.observations.next_seq(), time.time(), arm, status, error, ttft, tpot,
                          time.perf_counter() - start, relay.attempt_tokens if relay else 0, retried)
        self.observations.items.append(obs)
        self.metrics.record(obs)
        if retried:
            self.metrics.retries.inc()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = json.loads(await request.read())
            if not isinstance(payload, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return error_response(400, f"the request body must be a JSON object: {e}", "invalid_request_error")
        arm = self.choose(request, payload)
        stats = request.get(STATS, {})
        mirror = self._mirror_wanted(payload)
        work = asyncio.ensure_future(self._stream(request, payload, arm, stats) if payload.get("stream")
                                     else self._whole(request, payload, arm, stats))
        cut = asyncio.ensure_future(self.admission.until_cut())
        try:
            await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
        if not work.done():  # the drain timed out: end the answer instead of dropping the connection
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return await self._cut(request, stats)
        resp, answer = work.result()
        if mirror and answer is not None and not stats.get("retried"):  # a retried answer is two arms' text
            self._start_mirror(payload, stats["arm"], answer.text() if isinstance(answer, SSERelay) else answer)
        return resp

    async def _cut(self, request: web.Request, stats: dict[str, Any]) -> web.StreamResponse:
        message = (f"the router shut down before this answer was complete (drain timeout "
                   f"{self.admission.config.drain_timeout_s:g} s); retry")
        stats["error"] = f"service_unavailable: {message}"
        resp = request.get(STARTED)
        if resp is None:
            return error_response(503, message, "service_unavailable")
        event = json.dumps({"error": {"message": message, "type": "service_unavailable", "code": 503}})
        with contextlib.suppress(ConnectionResetError, RuntimeError):  # the client may be gone too
            await resp.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
        return resp

    async def _stream(self, request: web.Request, payload: dict[str, Any], arm: str,
                      stats: dict[str, Any]) -> tuple[web.StreamResponse, SSERelay | None]:
        """Relay a stream; a failing canary is retried (or continued) on stable."""
        arrival = time.perf_counter()
        options = payload.get("stream_options") or {}
        relay = SSERelay(strip_usage=not options.get("include_usage"))
        upstream = {**payload, "stream_options": {**options, "include_usage": True}}
        body, resp, retried = upstream, None, False
        while True:
            start = time.perf_counter()
            relay.new_attempt()
            status, error, resp, client_gone = await self._attempt_stream(request, self.backends[arm], body, relay, resp)
            if client_gone:
                self._record(arm, 499, "client disconnected", start, relay)
                return resp, None  # type: ignore[return-value]
            nxt = None
            if error is not None and is_failure(status, error) and arm == "canary" and "stable" in self.backends:
                nxt = continuation(upstream, relay.text(), relay.tokens)
            self._record(arm, status, error, start, relay, retried=nxt is not None)
            if error is None:
                break
            limit = max_new_tokens(payload)
            if resp is not None and limit is not None and relay.tokens >= limit:
                await resp.write(b"data: [DONE]\n\n")  # every token was sent; only the end was lost
                break
            if nxt is not None:
                arm, body, retried = "stable", nxt, True
                continue
            if resp is None:
                return error_response(status, f"{arm} backend failed: {error}", "upstream_error"), None
            await resp.write(b'data: {"error": {"message": "upstream failed mid-stream", "code": 502}}\n\n')
            break
        await resp.write_eof()  # type: ignore[union-attr]
        self._stats(stats, arm, retried, arrival, relay)
        return resp, relay  # type: ignore[return-value]

    async def _attempt_stream(self, request: web.Request, backend: Backend, body: dict[str, Any], relay: SSERelay,
                              resp: web.StreamResponse | None) -> tuple[int, str | None, web.StreamResponse | None, bool]:
        """One backend attempt: (status, error or None, the client response once started, client left)."""
        backend.in_flight += 1
        try:
            async with backend.post(request.path, body, self._headers()) as up:
                if up.status != 200:
                    return up.status, (await up.text())[:300] or f"HTTP {up.status}", resp, False
                async for chunk in up.content.iter_any():
                    out = relay.feed(chunk)
                    if not out:
                        continue
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                        request[STARTED] = resp
                    try:
                        await resp.write(out)
                    except (ConnectionResetError, RuntimeError):
                        return 499, "client disconnected", resp, True
                if not relay.done:
                    return 502, "stream ended before [DONE]", resp, False
                return 200, None, resp, False
        except UPSTREAM_ERRORS as e:
            return 502, f"{type(e).__name__}: {e}"[:300], resp, False
        finally:
            backend.in_flight -= 1

    async def _whole(self, request: web.Request, payload: dict[str, Any], arm: str,
                     stats: dict[str, Any]) -> tuple[web.StreamResponse, str | None]:
        retried = False
        while True:
            backend, start = self.backends[arm], time.perf_counter()
            backend.in_flight += 1
            try:
                async with backend.post(request.path, payload, self._headers()) as up:
                    status, data = up.status, await up.read()
                error = None if status == 200 else data[:300].decode(errors="replace") or f"HTTP {status}"
            except UPSTREAM_ERRORS as e:
                status, data, error = 502, b"", f"{type(e).__name__}: {e}"[:300]
            finally:
                backend.in_flight -= 1
            failover = error is not None and is_failure(status, error) and arm == "canary" and "stable" in self.backends
            self._record(arm, status, error, start, None, retried=failover)
            if failover:
                arm, retried = "stable", True
                continue
            break
        if error is not None:
            return (web.Response(body=data, status=status, content_type="application/json") if data
                    else error_response(status, f"{arm} backend failed: {error}", "upstream_error")), None
        parsed = json.loads(data)
        usage = parsed.get("usage") or {}
        stats.update(arm=arm, retried=retried, tokens_in=usage.get("prompt_tokens"), tokens_out=usage.get("completion_tokens"))
        return web.Response(body=data, status=200, content_type="application/json"), _answer_text(parsed)

    def _stats(self, stats: dict[str, Any], arm: str, retried: bool, arrival: float, relay: SSERelay) -> None:
        usage = relay.usage or {}
        stats.update(arm=arm, retried=retried, tokens_in=usage.get("prompt_tokens"),
                     tokens_out=usage.get("completion_tokens", relay.tokens))
        if relay.first is not None:
            stats["ttft_ms"] = (relay.first - arrival) * 1000
            if relay.tokens > 1 and relay.last is not None:
                stats["tpot_ms"] = (relay.last - relay.first) / (relay.tokens - 1) * 1000

    # --- mirroring ------------------------------------------------------------------------
    # A mirror is the router's own request, after the client has its answer: it never changes what
    # the client receives, carries none of the client's identity, and is the first thing dropped
    # under load (router.py cancels mirrors in flight when a client would wait for a slot).
    def _mirror_wanted(self, payload: dict[str, Any]) -> bool:
        """Only greedy requests are comparable: sampled answers differ even between identical models."""
        if not (self.cfg.mirror_fraction > 0 and "canary" in self.backends and payload.get("temperature") == 0
                and payload.get("n", 1) == 1 and random.random() < self.cfg.mirror_fraction):
            return False
        a = self.admission
        if a.draining or a.waiting or a.running + len(self._mirrors) > a.slots or len(self._mirrors) >= MAX_MIRRORS_IN_FLIGHT:
            self.metrics.mirror_dropped.labels(names.MIRROR_LOAD).inc()
            return False
        return True

    def _start_mirror(self, payload: dict[str, Any], primary: str, text: str) -> None:
        task = asyncio.get_running_loop().create_task(self._mirror(payload, primary, text))
        self._mirrors.add(task)
        task.add_done_callback(self._mirrors.discard)

    def drop_mirrors(self) -> None:
        """Cancel every mirror in flight (a client is about to wait for a slot)."""
        for task in list(self._mirrors):
            task.cancel()
            self.metrics.mirror_dropped.labels(names.MIRROR_LOAD).inc()

    async def _mirror(self, payload: dict[str, Any], primary: str, text: str) -> None:
        """Two more answers to the client's prompt, so it has three: stable's twice and the canary's
        once. The canary's and stable's second answer are each scored against stable's first: the
        canary's agreement and its noise floor (how far stable agrees with itself), one pair."""
        body = {k: v for k, v in payload.items() if k not in MIRROR_DROPS}
        arms = ("canary", "stable") if primary == "stable" else ("stable", "stable")
        answers = await asyncio.gather(*(self._ask(arm, body) for arm in arms))
        if None in answers:
            self.metrics.mirror_dropped.labels(names.MIRROR_FAILED).inc()
            return
        first, canary, second = (text, *answers) if primary == "stable" else (answers[0], text, answers[1])
        prefix, match = served_scores(first, canary)
        floor_prefix, floor_match = served_scores(first, second)
        comparison = Comparison(self.comparisons.next_seq(), time.time(), primary, prefix, match,
                                floor_prefix, floor_match)
        self.comparisons.items.append(comparison)
        self.metrics.record_mirror(comparison)

    async def _ask(self, arm: str, body: dict[str, Any]) -> str | None:
        """One mirrored answer from `arm`, or None when it failed (the comparison is then dropped)."""
        backend = self.backends.get(arm)
        if backend is None:
            return None
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            async with backend.post(path, body, self._headers()) as up:
                return _answer_text(await up.json()) if up.status == 200 else None
        except (*UPSTREAM_ERRORS, ValueError):
            return None


def _answer_text(parsed: dict[str, Any]) -> str:
    choice = (parsed.get("choices") or [{}])[0]
    return choice.get("text") or (choice.get("message") or {}).get("content") or ""
