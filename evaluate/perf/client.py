"""The streaming HTTP client: one request in, one `RequestRecord` with per-chunk timestamps out.

Built to cost little CPU per request, because on a small machine the client's CPU decides the
highest rate it can send honestly (FIELD.md: ~1 ms per streamed request for plain aiohttp +
uvloop, against 3-18 ms for the field's generators). So: pooled keep-alive connections whose
bytes are parsed in the protocol callback (http.py), no JSON parsing of token chunks (a regex
says whether a chunk carries text; only the usage chunk and errors are parsed), one
`time.perf_counter()` per network read shared by the chunks in it, one coroutine wake-up per
request rather than per token.

Token counts come from the server's usage chunk (`stream_options.include_usage`) when present,
otherwise from the number of non-empty chunks. ITL is measured between chunks: with a server
that packs several tokens into one chunk, ITL is per chunk while TPOT stays per token.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kiln.core import progress
from kiln.evaluate.perf.http import HTTPError, StreamingHTTP

# A chunk carries output when its text/content string is non-empty (`"content":""` role chunks
# and `"text":""` finish chunks are not tokens).
_CONTENT = re.compile(rb'"(?:text|content)":\s?"(?!")')
_USAGE = re.compile(rb'"usage":\s?\{')


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are `time.perf_counter()` seconds."""

    request_id: str
    scheduled: float  # when the load shape said to send it
    sent: float = 0.0  # when its bytes went to the socket; 0 if they never did (lateness is measured, not hidden)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    done: float | None = None
    input_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens served from the server's prompt cache, when it says
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def queue_time(self) -> float:
        return self.sent - self.scheduled

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] - self.sent if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_tokens - 1): time per token after the first, TTFT excluded."""
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    def to_json(self, t0: float) -> dict[str, Any]:
        """The JSONL row: times relative to the stage start `t0`, latencies in seconds."""
        return {
            "request_id": self.request_id,
            "scheduled": self.scheduled - t0,
            "sent": self.sent - t0 if self.sent else None,
            "queue_time": self.queue_time if self.sent else None,
            "ttft": self.ttft,
            "itl": self.itl,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "error": self.error,
        }


class _SSE:
    """Server-sent events of one response, parsed as bytes arrive (called from the protocol)."""

    __slots__ = ("rec", "buf", "usage_tokens", "finished", "head")

    def __init__(self, rec: RequestRecord):
        self.rec, self.buf, self.usage_tokens, self.finished, self.head = rec, b"", None, False, b""

    def feed(self, data: bytes, now: float) -> None:
        if len(self.head) < 300:
            self.head += data[: 300 - len(self.head)]  # for the error message of a non-200 answer
        if self.buf:
            data = self.buf + data
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        *events, self.buf = data.split(b"\n\n")
        rec = self.rec
        for ev in events:
            if _CONTENT.search(ev):
                rec.chunk_times.append(now)
            if _USAGE.search(ev):
                usage = json.loads(ev[ev.index(b"{") :])["usage"]
                self.usage_tokens = usage.get("completion_tokens")
                rec.input_tokens = usage.get("prompt_tokens", rec.input_tokens)
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            elif b"data: [DONE]" in ev:
                self.finished = True
            elif b'"error"' in ev and _is_error(ev):
                rec.error = rec.error or f"stream error: {ev[:300].decode(errors='replace')}"


class StreamClient:
    """Async context manager: one pool of keep-alive connections to an OpenAI-compatible server.

    Token streams go through `StreamingHTTP` (parsed in the protocol callback, see http.py);
    aiohttp serves the one-off calls (model discovery).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        endpoint: str = "completions",
        timeout_s: float = 600,
    ):
        self.url = url.rstrip("/")
        self.path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self.api_key, self.model, self.timeout_s = api_key, model, timeout_s
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.http: StreamingHTTP | None = None

    async def __aenter__(self) -> StreamClient:
        self.http = StreamingHTTP(self.url, self.headers)
        if self.model is None:
            self.model = await self.first_model()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.http:
            self.http.close()

    async def first_model(self) -> str:
        headers = {k: v for k, v in self.headers.items() if k == "Authorization"}
        async with aiohttp.ClientSession(headers=headers) as s, s.get(self.url + "/v1/models") as r:
            if r.status != 200:
                raise RuntimeError(f"GET {self.url}/v1/models answered HTTP {r.status}; pass the model name explicitly")
            data = (await r.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{self.url}/v1/models lists no model; pass the model name explicitly")
        return data[0]["id"]

    async def send(self, rec: RequestRecord, body: dict[str, Any]) -> None:
        """Send one streaming request and fill `rec`. Never raises except on cancellation."""
        assert self.http is not None
        payload = json.dumps({"model": self.model, **body}, separators=(",", ":")).encode()
        sse = _SSE(rec)

        def sent(now: float) -> None:  # the real send: after any wait for a connection, not when the task began
            rec.sent = now

        try:
            async with asyncio.timeout(self.timeout_s):
                status = await self.http.post(self.path, payload, sse.feed, sent)
            rec.output_tokens = sse.usage_tokens if sse.usage_tokens is not None else len(rec.chunk_times)
            if status != 200:
                rec.error = f"HTTP {status}: {sse.head.decode(errors='replace')[:200]}"
            elif rec.error is None and not sse.finished:
                rec.error = "stream ended before [DONE]"
            elif rec.error is None and not rec.chunk_times:
                rec.error = "no output tokens in the stream"
        except asyncio.CancelledError:
            rec.error = "cancelled"
            raise
        except (HTTPError, TimeoutError, OSError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"[:300]
        finally:
            rec.done = time.perf_counter()
            progress.advance()  # the stage's progress (kiln.core.progress), when one is shown


def _is_error(event: bytes) -> bool:
    try:
        obj = json.loads(event[event.index(b"{") :])
    except ValueError:
        return False
    return isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error")


async def wait_ready(url: str, timeout_s: float = 60, api_key: str | None = None) -> None:
    """Poll GET /health until it answers 200 (engines answer 503 while loading)."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as s:
        while True:
            try:
                async with s.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:g} s")
            await asyncio.sleep(0.2)
