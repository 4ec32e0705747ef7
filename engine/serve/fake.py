"""A fake OpenAI-compatible engine that streams tokens at a set speed (a real tool, not a mock).

It exists to test load generators and canary controllers against a server whose true latency is
known: first token `ttft_ms` after a request gets a slot, then one token every `tpot_ms`, always
exactly `max_tokens` tokens (it never stops early, as if `ignore_eos` were set). At most
`capacity` requests generate at once; the rest wait in a FIFO queue, so TTFT grows with load the
way it does on a real engine. Every token is scheduled at an absolute time
(start + ttft + i * tpot), so timer lateness never accumulates over a stream.

Endpoints: POST /v1/completions and /v1/chat/completions (streaming SSE or not), GET /v1/models,
GET /health (503 until `startup_s` has passed), GET /metrics (Prometheus text), and GET/DELETE
/fake/stats (request arrival times as the server saw them, so a benchmark can check the rate a
client really sent without trusting the client). With an API key (several: comma-separated), /v1
and /fake need `Authorization: Bearer <key>`; /health and /metrics stay open for probes and
scrapers. A key that strips to nothing is refused at start, as `kiln serve` refuses it.

Prompt tokens are counted as token ids when given ids, and as whitespace-separated words for text
(a stand-in for a tokenizer, which a fake has no need of).

Use `FakeServer(config)` (a subprocess, so a client under test never shares a GIL with it) from
tests and benches, `serve_fake(...)` to serve in the foreground, `run_fake_server(...)` inside a
running event loop.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
import uuid

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from kiln.engine.serve import metric_names as names
from kiln.engine.serve.admission import api_keys
from kiln.engine.serve.auth import BearerAuth, Zone
from kiln.engine.remote import stop_process

_TOKEN = " tok"
_READY = "KILN_FAKE_READY"
_API_KEY_ENV = "KILN_FAKE_API_KEY"
# Buckets sized for fake-engine timings (ms to tens of seconds).
_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)


class FakeEngineConfig(BaseModel):
    """How the fake engine behaves. Times are per request, before `slowdown`."""

    model_config = ConfigDict(extra="forbid")

    model: str = "kiln-fake"
    ttft_ms: float = Field(50.0, ge=0, description="time from getting a slot to the first token")
    tpot_ms: float = Field(10.0, ge=0, description="interval between consecutive tokens")
    capacity: int | None = Field(None, ge=1, description="max requests generating at once; None = unlimited")
    slowdown: float = Field(1.0, gt=0, description="multiplies ttft_ms and tpot_ms (a slower candidate)")
    error_rate: float = Field(0.0, ge=0, le=1, description="fraction of requests answered HTTP 500")
    seed: int = 0
    startup_s: float = Field(0.0, ge=0, description="/health answers 503 for this long after start")
    default_max_tokens: int = Field(16, ge=1, description="when a request gives no max_tokens")


class _Metrics:
    """Prometheus series: exactly `kiln serve`'s names (metric_names.py)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(names.TTFT, "TTFT, arrival to first token", registry=r, buckets=_BUCKETS)
        self.tpot = Histogram(names.TPOT, "mean inter-token time", registry=r, buckets=_BUCKETS)
        self.e2e = Histogram(names.E2E, "arrival to last token", registry=r, buckets=_BUCKETS)
        self.running = Gauge(names.RUNNING, "requests generating", registry=r)
        self.waiting = Gauge(names.WAITING, "requests queued for a slot", registry=r)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "prompt tokens processed", registry=r)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "tokens generated", registry=r)
        self.requests = Counter(names.REQUESTS, "requests finished, by outcome", [names.OUTCOME], registry=r)
        for o in names.OUTCOMES:  # every series exists from the start, as kiln serve's
            self.requests.labels(o)


class _BadRequest(Exception):
    pass


def _count_prompt(body: dict) -> list[int]:
    """Prompt token counts, one per prompt (a completions request may carry several)."""
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise _BadRequest("'messages' must be a non-empty list")
        return [sum(len(str(m.get("content") or "").split()) for m in msgs if isinstance(m, dict))]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [len(prompt.split())]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return [len(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [len(p.split()) for p in prompt]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt]
    raise _BadRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    )


class _Engine:
    """The request handlers and the state they share (slots, metrics, error RNG)."""

    def __init__(self, config: FakeEngineConfig, api_key: str | None):
        self.cfg = config
        keys = api_keys(api_key)
        self.auth = BearerAuth([Zone("/v1/", keys), Zone("/fake/", keys)])
        self.ttft = config.ttft_ms * config.slowdown / 1000
        self.tpot = config.tpot_ms * config.slowdown / 1000
        self.slots = asyncio.Semaphore(config.capacity) if config.capacity else None
        self.rng = random.Random(config.seed)
        self.metrics = _Metrics()
        self.started = time.monotonic()
        self.arrivals: collections.deque[float] = collections.deque(maxlen=2_000_000)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth.middleware], client_max_size=64 * 1024**2)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/fake/stats", self.stats)
        app.router.add_delete("/fake/stats", self.stats)
        return app

    async def health(self, request: web.Request) -> web.Response:
        ready = time.monotonic() - self.started >= self.cfg.startup_s
        return web.json_response({"status": "ok" if ready else "starting"}, status=200 if ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.cfg.model, "object": "model", "created": int(self.started), "owned_by": "kiln"}
        return web.json_response({"object": "list", "data": [card]})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8")

    async def stats(self, request: web.Request) -> web.Response:
        arrivals = list(self.arrivals)
        if request.method == "DELETE":
            self.arrivals.clear()
        return web.json_response({"arrivals": arrivals, "clock": "time.monotonic, seconds"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.monotonic()
        self.arrivals.append(arrival)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise _BadRequest("the request body must be a JSON object")
            prompts = _count_prompt(body)
            n = body.get("max_tokens", body.get("max_completion_tokens", self.cfg.default_max_tokens))
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise _BadRequest("'max_tokens' must be a positive integer")
        except (json.JSONDecodeError, _BadRequest) as e:
            self.metrics.requests.labels(names.CLIENT_ERROR).inc()
            return _error(400, str(e), "invalid_request_error")
        if self.cfg.error_rate and self.rng.random() < self.cfg.error_rate:
            self.metrics.requests.labels(names.SERVER_ERROR).inc()
            return _error(500, "injected failure (fake engine error_rate)", "server_error")
        chat = request.path.endswith("/chat/completions")
        stream = _Stream(self, request, body, prompts, n, chat, arrival)
        if self.slots is None:
            return await stream.run()
        self.metrics.waiting.inc()
        try:
            await self.slots.acquire()
        finally:
            self.metrics.waiting.dec()
        try:
            return await stream.run()
        finally:
            self.slots.release()


class _Stream:
    """One request's generation: tokens at absolute times, written as SSE or returned whole."""

    def __init__(
        self, eng: _Engine, request: web.Request, body: dict, prompts: list[int], n: int, chat: bool, arrival: float
    ):
        self.eng, self.request, self.body, self.prompts, self.n = eng, request, body, prompts, n
        self.chat, self.arrival = chat, arrival
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.usage = {
            "prompt_tokens": sum(prompts),
            "completion_tokens": n * len(prompts),
            "total_tokens": sum(prompts) + n * len(prompts),
        }

    async def run(self) -> web.StreamResponse:
        m = self.eng.metrics
        m.running.inc()
        try:
            start = time.monotonic()
            if self.body.get("stream"):
                resp, first, last = await self._stream(start)
            else:
                first = start + self.eng.ttft
                last = await _sleep_until(first + (self.n - 1) * self.eng.tpot)
                resp = web.json_response(self._whole())
        except ConnectionResetError:  # the client hung up mid-stream (a cancelled load test): not our error
            m.requests.labels(names.CANCELLED).inc()  # the client left
            return self.resp  # already started; there is nobody left to answer
        finally:
            m.running.dec()
        m.ttft.observe(first - self.arrival)
        m.e2e.observe(last - self.arrival)
        if self.n > 1:
            m.tpot.observe((last - first) / (self.n - 1))
        m.prompt_tokens.inc(self.usage["prompt_tokens"])
        m.generation_tokens.inc(self.usage["completion_tokens"])
        m.requests.labels(names.SUCCESS).inc()
        return resp

    def _head(self) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.eng.cfg.model}

    def _chunks(self, finish: str | None, first: bool) -> bytes:
        """One SSE event per prompt for one token step (pre-rendered once per step kind)."""
        out = []
        for i in range(len(self.prompts)):
            if self.chat:
                delta = {"role": "assistant", "content": _TOKEN} if first else {"content": _TOKEN}
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": _TOKEN, "logprobs": None, "finish_reason": finish}
            out.append(
                b"data: " + json.dumps({**self._head(), "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"
            )
        return b"".join(out)

    async def _stream(self, start: float) -> tuple[web.StreamResponse, float, float]:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        self.resp = resp = web.StreamResponse(headers=headers)
        await resp.prepare(self.request)
        ttft, tpot, n = self.eng.ttft, self.eng.tpot, self.n
        first = await _sleep_until(start + ttft)
        await resp.write(self._chunks("length" if n == 1 else None, True))  # also flushes the headers
        last = first
        if n > 1:
            transport = self.request.transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError("client went away")
            mid, end = _framed(self._chunks(None, False)), _framed(self._chunks("length", False))
            last = await _Ticker(transport, start + ttft, tpot, n, mid, end).run()
        opts = self.body.get("stream_options") or {}
        if opts.get("include_usage"):
            tail = {**self._head(), "choices": [], "usage": self.usage}
            await resp.write(b"data: " + json.dumps(tail, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp, first, last

    def _whole(self) -> dict:
        text = _TOKEN * self.n
        if self.chat:
            choices = [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ]
            obj = "chat.completion"
        else:
            choices = [
                {"index": i, "text": text, "logprobs": None, "finish_reason": "length"}
                for i in range(len(self.prompts))
            ]
            obj = "text_completion"
        return {**self._head(), "object": obj, "choices": choices, "usage": self.usage}


def _framed(event: bytes) -> bytes:
    """One HTTP/1.1 chunk, framed as aiohttp's chunked writer would frame it."""
    return b"%x\r\n%s\r\n" % (len(event), event)


class _Ticker:
    """Writes tokens 1..n-1 of a stream from timer callbacks straight to the transport.

    The hot path of the fake: a coroutine resumed per token, plus aiohttp's writer, costs more
    CPU than the load generators under test, and on a shared 2-core machine the fake's CPU
    decides how fast any client can look. After the first token (written through aiohttp, which
    sends the headers and turns on chunked encoding) each token is one pre-framed chunk written
    at its absolute time, start + ttft + i * tpot.
    """

    def __init__(self, transport: asyncio.BaseTransport, first_at: float, tpot: float, n: int, mid: bytes, end: bytes):
        self.transport, self.first_at, self.tpot, self.n, self.mid, self.end = transport, first_at, tpot, n, mid, end
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.i = 1

    def run(self) -> asyncio.Future:
        self._arm()
        return self.done

    def _arm(self) -> None:
        self.loop.call_later(max(0.0, self.first_at + self.i * self.tpot - time.monotonic()), self._tick)

    def _tick(self) -> None:
        if self.done.done():
            return
        if self.transport.is_closing():
            self.done.set_exception(ConnectionResetError("client went away"))
            return
        now = time.monotonic()
        if self.first_at + self.i * self.tpot - now > 0.0002:  # the loop's timer fired early
            self._arm()
            return
        self.transport.write(self.end if self.i == self.n - 1 else self.mid)  # type: ignore[attr-defined]
        self.i += 1
        if self.i == self.n:
            self.done.set_result(now)
        else:
            self._arm()


async def _sleep_until(target: float) -> float:
    """Sleep until a monotonic deadline; event-loop timers have ~1 ms granularity and may fire a
    little early, so re-check against the clock rather than trusting one sleep."""
    while (left := target - time.monotonic()) > 0.0002:
        await asyncio.sleep(left)
    return time.monotonic()


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


async def run_fake_server(
    config: FakeEngineConfig, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None
) -> tuple[web.AppRunner, int]:
    """Start the fake engine inside the running event loop; returns (runner, bound port).

    Stop it with `await runner.cleanup()`. Port 0 binds a free port.
    """
    runner = web.AppRunner(_Engine(config, api_key).app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def serve_fake(config: FakeEngineConfig, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    """Serve the fake engine in the foreground until interrupted (what `kiln fake-engine` runs)."""
    import uvloop

    async def main() -> None:
        runner, bound = await run_fake_server(config, host, port, api_key)
        print(f"{_READY} {bound}", flush=True)
        print(f"kiln fake engine '{config.model}' listening on http://{host}:{bound}", file=sys.stderr, flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


class FakeServer:
    """Context manager running the fake engine in a subprocess; `.url` once entered.

    A separate process keeps the server's CPU out of the client's GIL, as in production.
    """

    def __init__(self, config: FakeEngineConfig | None = None, api_key: str | None = None, start_timeout_s: float = 30):
        self.config = config or FakeEngineConfig()
        self.api_key = api_key
        self._bearer = next(iter(api_keys(api_key)), b"").decode()  # refuses a blank key before the child starts
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> FakeServer:
        env = {**os.environ, _API_KEY_ENV: self.api_key or ""}
        cmd = [sys.executable, "-m", "kiln.engine.serve.fake", self.config.model_dump_json()]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = _readline_with_timeout(self.proc, self.start_timeout_s)
        if not line.startswith(_READY):
            self.__exit__(None, None, None)
            raise RuntimeError(f"fake engine did not start (first output: {line!r})")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc, 10)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def arrivals(self, reset: bool = False) -> list[float]:
        """Arrival times (server's monotonic clock) of every request since the last reset."""
        req = urllib.request.Request(self.url + "/fake/stats", method="DELETE" if reset else "GET")
        if self._bearer:
            req.add_header("Authorization", f"Bearer {self._bearer}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["arrivals"]


def _readline_with_timeout(proc: subprocess.Popen[str], timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    ready = sel.select(timeout_s)
    sel.close()
    return proc.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]


if __name__ == "__main__":
    # `python -m kiln.engine.serve.fake '<config json>'`: what FakeServer runs (the API key comes
    # through the environment so it never shows in `ps`).
    serve_fake(FakeEngineConfig.model_validate_json(sys.argv[1]), "127.0.0.1", 0, os.environ.get(_API_KEY_ENV) or None)
