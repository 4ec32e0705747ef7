"""`kiln serve ENGINE_DIR`: any built engine behind an OpenAI-compatible HTTP API.

aiohttp on uvloop, loopback by default, optional Bearer API keys (several, comma-separated: one
per tenant). Routes: POST /v1/completions (streaming SSE or not; echo + logprobs so lm-eval's
`local-completions` can score), POST /v1/chat/completions, GET /v1/models, GET /health (503
until the engine is loaded and warmed up, and again while draining), GET /metrics (Prometheus).
One scheduler owns the engine (scheduler.py: its thread steps it, or the event loop polls an engine
that reads its tokens from sockets); a client that disconnects has its sequence cancelled. Every
client mistake is an OpenAI-style JSON 4xx (request.py validates a request before it joins the
shared batch; unknown routes, wrong methods and oversized bodies answer JSON too).

Production guards come from engine/serve/admission.py (shared with `kiln route`): a bounded queue
(slots = the engine's batch, a wait bounded in time; full: a fast 429 whose Retry-After is the
estimated wait), per-API-key rate limits, drain on SIGTERM (no new work, in-flight streams finish,
exit 0) and one JSON log line per request (queue time, TTFT, TPOT, tokens in/out). Cold start
(process start to ready, split into boot, engine load and warm-up) is logged, shown in /health and
exported to /metrics. An engine that reports its prompt cache (TokenEvent.stats: llama.cpp's server
runtime) fills each answer's `usage.prompt_tokens_details.cached_tokens` as OpenAI's API does, the
log line's `cached_tokens` and the counters `kiln:prefix_cache_queries` / `kiln:prefix_cache_hits`;
a request's `cache_prompt: false` (llama.cpp's name) asks the engine not to use the cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from kiln.engine.serve import metric_names as names
from kiln.engine.serve.admission import (ARRIVAL, SERVE_ADMISSION, STATS, Admission, AdmissionConfig, DrainCut,
                                   api_keys, serve_until_drained)
from kiln.engine.serve.auth import BearerAuth, Zone
from kiln.engine.base import Engine, GenerationRequest, TokenEvent
from kiln.engine.serve.protocol import TextStream, logprobs_block, position_logprobs, token_text
from kiln.engine.serve.request import (RequestError, Sampling, budgets, chat_prompt, check_model, parse_prompts,
                                 parse_sampling, read_body)
from kiln.engine.serve.scheduler import Metrics, Scheduler
from kiln.core.errors import BadInput

STATE = web.AppKey("state", object)
STARTER = web.AppKey("starter", asyncio.Task)


class _State:
    def __init__(self, load: Callable[[], Engine], api_key: str | None, model_name: str | None, owns: bool,
                 admission: Admission, on_ready: Callable[[dict[str, float]], None] | None):
        self.load, self.model_name, self.owns = load, model_name, owns
        self.auth = BearerAuth([Zone("/", api_keys(api_key))])  # every path but /health and /metrics
        self.admission, self.on_ready = admission, on_ready
        self.metrics = Metrics()
        admission.export(self.metrics.registry, names.ADMISSION, count_requests=True)
        self.cache_queries = Counter(names.PREFIX_CACHE_QUERIES, "Prompt tokens of requests whose engine reported "
                                     "its prompt cache", registry=self.metrics.registry)
        self.cache_hits = Counter(names.PREFIX_CACHE_HITS, "Of those, prompt tokens served from the engine's prompt "
                                  "cache", registry=self.metrics.registry)
        self.engine: Engine | None = None
        self.scheduler: Scheduler | None = None
        self.status = "loading"
        self.cold_start: dict[str, float] | None = None
        self.error: Exception | None = None
        self.failed = asyncio.Event()  # set when loading or warm-up failed: `serve` exits

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        began = time.time()
        try:
            self.engine = await loop.run_in_executor(None, self.load)
            loaded = time.time()
            self.model_name = self.model_name or _default_name(self.engine)
            self.admission.size(batch_size(self.engine))
            self.scheduler = Scheduler(self.engine, loop, self.metrics)
            self.scheduler.start()
            self.status = "warming up"
            await self.scheduler.call(_warm_up)
            self._ready(_cold_start(began, loaded, time.time()))
        except Exception as e:  # /health reports it; `serve` stops with it, a ServerThread stays up
            self.status, self.error = f"failed: {type(e).__name__}: {e}", e
            self.failed.set()

    def _ready(self, cold: dict[str, float]) -> None:
        self.cold_start = cold
        for phase, seconds in cold.items():
            self.metrics.cold_start.labels(phase.removesuffix("_s")).set(seconds)
        logging.getLogger("kiln.serve").info(json.dumps({"event": "ready", **cold}))
        self.status = "ready"
        if self.on_ready:
            self.on_ready(cold)


def _process_age() -> float:
    """Seconds since this process started. On Linux from /proc to 10 ms; psutil's create_time
    rests on a boot time rounded to the second, so it can be a second off either way."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, ValueError):  # not Linux
        return time.time() - psutil.Process().create_time()


def _cold_start(began: float, loaded: float, ready: float) -> dict[str, float]:
    """Process start to ready (wall clock), in phases: boot (interpreter, imports, server up to
    the start of the load), engine load, warm-up. The phases add up to the total."""
    born = ready - _process_age()
    phases = {"boot_s": began - born, "load_s": loaded - began, "warmup_s": ready - loaded, "total_s": ready - born}
    return {k: round(v, 3) for k, v in phases.items()}


def batch_size(engine: Engine) -> int | None:
    """Sequences the engine decodes at once (its config's max_batch_size), if it has such a bound."""
    size = (engine.manifest.get("config") or {}).get("max_batch_size")
    return size if isinstance(size, int) and size > 0 else None


def _default_name(engine: Engine) -> str:
    """The model folder's name, as vLLM serves a model under its path. An engine built from an optimize
    stage's checkpoint (`<stage>/model`) takes the name of the folder that checkpoint was made from."""
    from kiln.optimize.base import MANIFEST

    source = (engine.manifest.get("source") or {}).get("path") or engine.manifest.get("build", {}).get("checkpoint")
    if not source:
        return engine.manifest.get("backend", "kiln")
    made_from = Path(source) / MANIFEST
    if made_from.is_file():
        origin = json.loads(made_from.read_text()).get("source")
        if isinstance(origin, str) and origin:
            return Path(origin).name
    return Path(source).name


def _warm_up(engine: Engine) -> None:
    """One short generation and one scoring pass, so the first real request is not the slow one."""
    ids = list(engine.tokenizer("Hello, world").input_ids)
    ids = ids if len(ids) > 1 else ids * 2
    list(engine.generate([GenerationRequest(ids, 2, ignore_eos=True)]))
    engine.score([(ids[:1], ids[1:])])


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | int | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """The OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _guard(request: web.Request, handler):
    """Key and readiness, before admission: a wrong key never gets a rate-limit bucket or a slot."""
    st: _State = request.app[STATE]
    refusal = st.auth.refusal(request)
    if refusal is None and request.path.startswith("/v1/") and st.status != "ready":
        refusal = _error(503, f"Engine not ready: {st.status}.", "service_unavailable")
    if refusal is None:
        return await handler(request)
    if request.path in st.admission.paths:  # counted by outcome like every answered generation request
        st.admission.count(refusal.status)
    return refusal


@web.middleware
async def _errors(request: web.Request, handler):
    """Errors as OpenAI-style JSON, inside admission so the request log sees the real status."""
    try:
        return await handler(request)
    except RequestError as e:
        return _error(e.status, str(e), param=e.param, code=e.code)
    except BadInput as e:
        return _error(400, str(e))
    except DrainCut as e:
        return _error(503, str(e), "service_unavailable", headers={"Connection": "close"})
    except web.HTTPException as e:  # aiohttp's own 404, 405, 413: JSON like every other error
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return _error(e.status, f"{request.method} {request.path}: {e.text or e.reason}", kind, headers=allow)
    except Exception as e:  # an engine failure: report it as JSON, keep serving
        return _error(500, f"{type(e).__name__}: {e}", "internal_error")


async def health(request: web.Request) -> web.Response:
    """200 once ready; 503 while loading, warming up, failed or draining (load balancers stop sending)."""
    st: _State = request.app[STATE]
    code, body = st.admission.health()
    if code == 200:
        body = {**body, "status": st.status, "cold_start": st.cold_start}
        code = 200 if st.status == "ready" else 503
    return web.json_response(body, status=code)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def models(request: web.Request) -> web.Response:
    st: _State = request.app[STATE]
    card = {"id": st.model_name, "object": "model", "created": 0, "owned_by": "kiln"}
    return web.json_response({"object": "list", "data": [card]})


async def _events(st: _State, ids: list[int], s: Sampling) -> AsyncIterator[TokenEvent]:
    """Generate for one prompt; leaving early (stop string, disconnect) cancels the sequence."""
    ticket = st.scheduler.submit(_generation(ids, s))
    try:
        while (ev := await ticket.events.get()) is not None:
            if isinstance(ev, Exception):
                raise _raised(ev)
            yield ev
    finally:
        st.scheduler.cancel(ticket)


def _generation(ids: list[int], s: Sampling) -> GenerationRequest:
    # Only a streamed choice takes its logprobs from the events; a non-streamed one scores them (_add_logprobs).
    return GenerationRequest(ids, s.max_tokens, s.ignore_eos, s.stop_token_ids, s.temperature, s.seed, s.top_p,
                             logprobs=s.stream and s.logprobs is not None, cache_prompt=s.cache_prompt)


def _raised(error: Exception) -> Exception:
    """What a handler raises for an error the scheduler delivered (BadInput: the request's fault)."""
    return BadInput(str(error)) if isinstance(error, BadInput) else error


async def _pieces(st: _State, ids: list[int], s: Sampling) -> AsyncIterator[tuple[str, str | None, TokenEvent]]:
    """(text delta, finish reason or None, token event) as generation proceeds; text honours `stop`."""
    text = TextStream(st.engine.tokenizer, s.stop)
    async with contextlib.aclosing(_events(st, ids, s)) as events:
        async for ev in events:
            delta = text.push(ev.token_id, final=ev.finish_reason is not None)
            if text.stopped or ev.finish_reason:
                yield delta, "stop" if text.stopped else ev.finish_reason, ev
                return
            yield delta, None, ev


class _Clock:
    """Token times of one request for its log line: TTFT from arrival (queue included), TPOT per
    choice (first to last token over the tokens after the first), averaged over choices."""

    def __init__(self, arrival: float, choices: int):
        self.arrival = arrival
        self.first: list[float | None] = [None] * choices
        self.last = [0.0] * choices
        self.count = [0] * choices
        self.cached: list[int | None] = [None] * choices  # prompt tokens the engine served from its prompt cache

    def note(self, index: int, ev: TokenEvent) -> None:
        """A choice's last event: the engine's prompt-cache figure for it, when it reports one."""
        if ev.stats and "cached_tokens" in ev.stats:
            self.cached[index] = ev.stats["cached_tokens"]

    def cached_tokens(self) -> int | None:
        """Over all choices; None unless the engine reported every one (a stop string cut it short, or none)."""
        return None if None in self.cached else sum(self.cached)  # type: ignore[arg-type]

    def tick(self, index: int) -> None:
        now = time.perf_counter()
        if self.first[index] is None:
            self.first[index] = now
        self.last[index], self.count[index] = now, self.count[index] + 1

    def stats(self) -> dict[str, float | int | None]:
        firsts = [f for f in self.first if f is not None]
        tpots = [(last - first) / (n - 1) for first, last, n in zip(self.first, self.last, self.count, strict=True)
                 if first is not None and n > 1]
        cached = {} if (c := self.cached_tokens()) is None else {"cached_tokens": c}
        return {"ttft_ms": (min(firsts) - self.arrival) * 1000 if firsts else None,
                "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None, "tokens_out": sum(self.count), **cached}


async def _complete(st: _State, index: int, ids: list[int], s: Sampling, clock: _Clock) -> tuple[dict, list[int]]:
    """One non-streamed completion choice (logprobs filled in later) and its generated tokens."""
    text, finish, generated = "", "length", []
    if s.max_tokens > 0:
        async for delta, reason, ev in _pieces(st, ids, s):
            clock.tick(index)
            if reason:
                clock.note(index, ev)
            text, finish = text + delta, reason or finish
            generated.append(ev.token_id)
    echo = st.engine.tokenizer.decode(ids) if s.echo else ""
    return {"index": index, "text": echo + text, "finish_reason": finish, "logprobs": None}, generated


async def _add_logprobs(st: _State, choices: list[dict], prompts: list[list[int]], generated: list[list[int]],
                        s: Sampling) -> None:
    """Fill each choice's logprobs from one batched scoring pass over prompt + generated tokens."""
    fulls = [p + g for p, g in zip(prompts, generated, strict=True)]
    top = s.logprobs or 0
    positions = await st.scheduler.call(lambda e: position_logprobs(e, fulls, top))
    for choice, prompt, full, pos in zip(choices, prompts, fulls, positions, strict=True):
        first = 0 if s.echo else len(prompt)
        choice["logprobs"] = logprobs_block(st.engine.tokenizer, full, pos, first, top, s.token_ids_as_text)


def _usage(prompts: list[list[int]], generated: int, cached: int | None = None) -> dict[str, Any]:
    n = sum(map(len, prompts))
    usage: dict[str, Any] = {"prompt_tokens": n, "completion_tokens": generated, "total_tokens": n + generated}
    if cached is not None:  # OpenAI's place for it; absent when the engine reports no prompt cache
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _count_cache(st: _State, prompts: list[list[int]], clock: _Clock) -> None:
    """The /metrics prompt-cache counters, for a request whose engine reported its cache."""
    cached = clock.cached_tokens()
    if cached is not None:
        st.cache_queries.inc(sum(map(len, prompts)))
        st.cache_hits.inc(cached)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _respond(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _respond(request, chat=True)


async def _respond(request: web.Request, chat: bool) -> web.StreamResponse:
    """Validate the whole request (a 4xx before anything is queued or streamed), then answer it."""
    st: _State = request.app[STATE]
    body = read_body(await request.read())
    check_model(body, st.model_name)
    s = parse_sampling(body, st.engine.vocab_size, chat=chat)
    prompts = [chat_prompt(body.get("messages"), st.engine.tokenizer)] if chat else \
        parse_prompts(body.get("prompt"), st.engine.tokenizer, st.engine.vocab_size)
    per_prompt = [replace(s, max_tokens=n)
                  for n in budgets(prompts, s, getattr(st.engine, "max_positions", None))]
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": st.model_name}
    stats, clock = request[STATS], _Clock(request[ARRIVAL], len(prompts))
    stats["tokens_in"] = sum(map(len, prompts))
    try:
        if s.stream:
            return await _stream(request, st, prompts, per_prompt, head, chat, clock)
        return await _answer(st, prompts, per_prompt, head, chat, clock)
    finally:
        stats.update(clock.stats())
        _count_cache(st, prompts, clock)


def _cut_message(st: _State) -> str:
    return (f"the server shut down before this answer was complete (drain timeout "
            f"{st.admission.config.drain_timeout_s:g} s); retry on another replica")


async def _unless_cut(st: _State, work: asyncio.Future) -> Any:
    """`work`'s result, or DrainCut (work cancelled) if the drain times out first."""
    cut = asyncio.ensure_future(st.admission.until_cut())
    try:
        done, _ = await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        cut.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise DrainCut(_cut_message(st))


async def _answer(st: _State, prompts: list[list[int]], per_prompt: list[Sampling], head: dict, chat: bool,
                  clock: _Clock) -> web.Response:
    """The whole answer in one JSON body. `per_prompt` differ in max_tokens only."""
    s = per_prompt[0]
    results = await _unless_cut(st, asyncio.gather(*(_complete(st, i, ids, per_prompt[i], clock)
                                                     for i, ids in enumerate(prompts))))
    choices, generated = [c for c, _ in results], [g for _, g in results]
    if s.logprobs is not None:
        await _add_logprobs(st, choices, prompts, generated, s)
    if chat:
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "finish_reason": c["finish_reason"], "logprobs": None} for c in choices]
    return web.json_response({**head, "object": "chat.completion" if chat else "text_completion",
                              "choices": choices,
                              "usage": _usage(prompts, sum(map(len, generated)), clock.cached_tokens())})


class _Tagged:
    """A ticket's event sink that puts (choice index, event) on the stream's one queue."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index

    def put_nowait(self, item: Any) -> None:
        self.queue.put_nowait((self.index, item))


async def _stream(request, st: _State, prompts, per_prompt: list[Sampling], head: dict, chat: bool,
                  clock: _Clock) -> web.StreamResponse:
    """SSE, one event per token. Every choice's tokens go straight from the scheduler to one queue
    this handler reads (no task per choice in between: one task wake-up per token, not two), and
    the constant head of each event is JSON-encoded once."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    send = _sender(resp, head, chat)
    if chat:
        await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    merged: asyncio.Queue = asyncio.Queue()
    texts = [TextStream(st.engine.tokenizer, p.stop) for p in per_prompt]
    tickets = [st.scheduler.submit(_generation(ids, per_prompt[i]), _Tagged(merged, i)) for i, ids in enumerate(prompts)]
    watcher = asyncio.create_task(_watch_cut(st, merged))
    try:
        generated = await _relay(st, merged, tickets, texts, per_prompt[0], chat, clock, send)
        if per_prompt[0].include_usage:
            await send([], usage=_usage(prompts, generated, clock.cached_tokens()))
    except ConnectionResetError:  # the client left; nothing to report to
        raise
    except Exception as e:  # the 200 header is already sent: report in-band, like vLLM
        await _send_error(request, resp, e)
    finally:
        watcher.cancel()
        for ticket in tickets:
            st.scheduler.cancel(ticket)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def _sender(resp: web.StreamResponse, head: dict, chat: bool) -> Callable[..., Awaitable[None]]:
    """`send(choices, **extra)`: one SSE event of the stream, its constant head encoded once."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    opening = f"data: {json.dumps({**head, 'object': kind})[:-1]}, "  # what json.dumps of the whole event starts with

    async def send(choices: list[dict], **extra: Any) -> None:
        rest = json.dumps({"choices": choices, **extra})[1:]
        await resp.write(f"{opening}{rest}\n\n".encode())

    return send


async def _watch_cut(st: _State, merged: asyncio.Queue) -> None:
    """Wake the stream's reader when drain cuts the streams still open."""
    await st.admission.until_cut()
    merged.put_nowait((-1, None))


async def _relay(st: _State, merged: asyncio.Queue, tickets: list, texts: list[TextStream], s: Sampling, chat: bool,
                 clock: _Clock, send: Callable[..., Awaitable[None]]) -> int:
    """Send each choice's tokens as they arrive until every choice has ended; returns the tokens sent.
    Raises DrainCut when drain cuts the stream, and an engine's error once the other choices ended."""
    generated, open_streams, error = 0, set(range(len(tickets))), None
    while open_streams:
        index, ev = await merged.get()
        if index < 0:
            raise DrainCut(_cut_message(st))
        if index not in open_streams:  # ended by a stop string; its last tokens were in flight
            continue
        if isinstance(ev, Exception):  # the others carry on; the stream then ends with the error
            open_streams.discard(index)
            error = error or _raised(ev)
            continue
        text = texts[index]
        delta = text.push(ev.token_id, final=ev.finish_reason is not None)
        finish = "stop" if text.stopped else ev.finish_reason
        if finish:
            open_streams.discard(index)
            st.scheduler.cancel(tickets[index])
            clock.note(index, ev)
        clock.tick(index)
        generated += 1
        if chat:
            await send([{"index": index, "delta": {"content": delta}, "finish_reason": finish}])
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": None}
            if s.logprobs is not None:
                choice["logprobs"] = {"tokens": [token_text(st.engine.tokenizer, ev.token_id, s.token_ids_as_text)],
                                      "token_logprobs": [ev.logprob], "top_logprobs": None}
            await send([choice])
    if error is not None:  # an engine error ends the stream with an error event, not as if complete
        raise error
    return generated


async def _send_error(request, resp: web.StreamResponse, e: Exception) -> None:
    """An error after the 200 header went out: one `error` event, and the request's stats say why."""
    kind = ("invalid_request_error" if isinstance(e, BadInput) else
            "service_unavailable" if isinstance(e, DrainCut) else "internal_error")
    request[STATS]["error"] = f"{kind}: {e}"[:300]
    await resp.write(f"data: {json.dumps({'error': {'message': str(e), 'type': kind}})}\n\n".encode())


def create_app(load: Callable[[], Engine], api_key: str | None = None, model_name: str | None = None,
               owns_engine: bool = True, admission: AdmissionConfig = SERVE_ADMISSION,
               on_ready: Callable[[dict[str, float]], None] | None = None) -> web.Application:
    """The HTTP app. `load` runs in a worker thread after the server is up (so /health can say 503);
    `on_ready(cold_start)` is called once the engine is loaded and warmed up. `api_key`: None for
    none, else one or more comma-separated keys; one that strips to nothing is BadInput."""
    guard = Admission(admission)
    app = web.Application(middlewares=[_guard, guard.middleware, _errors], client_max_size=64 * 2**20)
    st = app[STATE] = _State(load, api_key, model_name, owns_engine, guard, on_ready)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)

    async def on_startup(_app):
        _app[STARTER] = asyncio.create_task(st.start())

    async def on_cleanup(_app):
        _app[STARTER].cancel()
        if st.scheduler:
            st.scheduler.detach()
            await asyncio.get_running_loop().run_in_executor(None, st.scheduler.stop)
        if st.engine and st.owns:
            st.engine.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def serve(engine_dir: Path, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          model_name: str | None = None, admission: AdmissionConfig = SERVE_ADMISSION,
          on_ready: Callable[[dict[str, float]], None] | None = None, **engine_options: Any) -> None:
    """Serve a built engine until SIGTERM or SIGINT, then drain: /health and new requests get 503,
    in-flight requests finish (up to `admission.drain_timeout_s`), return (blocking).

    An engine that fails to load or warm up stops the server and raises the load's error (a broken
    engine folder is BadInput, naming the fix); a port in use is BadInput too."""
    import uvloop

    from kiln.engine.loader import load_engine

    app = create_app(lambda: load_engine(Path(engine_dir), **engine_options), api_key, model_name,
                     admission=admission, on_ready=on_ready)  # refuses a blank key before anything binds
    uvloop.run(_serve_or_fail(app, host, port))


async def _serve_or_fail(app: web.Application, host: str, port: int) -> None:
    st: _State = app[STATE]
    serving = asyncio.create_task(serve_until_drained(app, st.admission, host, port, handler_cancellation=True))
    failed = asyncio.create_task(st.failed.wait())
    await asyncio.wait({serving, failed}, return_when=asyncio.FIRST_COMPLETED)
    failed.cancel()
    if not serving.done():  # the engine failed: stop serving 503s and say why
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        raise st.error  # type: ignore[misc]
    try:
        serving.result()
    except OSError as e:  # EADDRINUSE, EACCES, a host with no such address
        raise BadInput(f"--host/--port: cannot listen on {host}:{port} ({e.strerror or e}). Choose another "
                       "--port, or stop the process that holds it.") from None


def main(argv: list[str] | None = None) -> None:
    """`python -m kiln.engine.serve.server ENGINE_DIR [--host H] [--port N]`, the API key from
    $KILN_API_KEY (never on the command line, where `ps` would show it), request log on stderr."""
    import argparse
    import os

    from kiln.engine.serve.admission import log_requests_to

    p = argparse.ArgumentParser(prog="python -m kiln.engine.serve.server", description=main.__doc__)
    p.add_argument("engine_dir", type=Path)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name in /v1/models and responses (default: the model folder's)")
    a = p.parse_args(argv)
    key = os.environ.get("KILN_API_KEY")
    try:
        api_keys(key, "$KILN_API_KEY")
    except BadInput as e:
        p.error(str(e))  # exit 2, as `kiln serve`'s
    log_requests_to("stderr")
    serve(a.engine_dir, a.host, a.port, key, a.served_model_name)


if __name__ == "__main__":
    main()
