"""Steady client load for canary drills: N concurrent clients streaming through the router.

A canary walk needs traffic; in tests, demos and bench/canary_sim.py this supplies it and counts
what a user would see: every request that did not end in a complete stream (HTTP error, broken
stream, no `[DONE]`) is a client failure. Runs its own event loop in a background thread so a
synchronous controller can run beside it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class LoadStats:
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)


class SteadyLoad:
    """`with SteadyLoad(url, concurrency=8) as load: ...`; `load.stats` while and after it runs."""

    def __init__(self, url: str, concurrency: int = 8, max_tokens: int = 8, api_key: str | None = None,
                 sessions: int = 200, think_s: float = 0.0):
        self.url, self.concurrency, self.max_tokens = url.rstrip("/"), concurrency, max_tokens
        self.api_key, self.sessions, self.think_s = api_key, sessions, think_s
        self.stats = LoadStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SteadyLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=120)

    async def _main(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        counter = itertools.count()
        async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:
            await asyncio.gather(*(self._client(session, counter) for _ in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, counter: itertools.count) -> None:
        while not self._stop.is_set():
            i = next(counter)
            # No "model": kiln serve answers an unknown name with 404, and the arms behind a router serve
            # different names; without one, each serves its own (as vLLM does).
            body = {"prompt": f"request {i} of session {i % self.sessions}", "stream": True,
                    "max_tokens": self.max_tokens, "temperature": 0}
            self.stats.sent += 1
            start = time.perf_counter()
            try:
                async with session.post(self.url + "/v1/completions", json=body,
                                        headers={"X-Session-Id": f"s{i % self.sessions}"}) as r:
                    first, last, broken = None, b"", False
                    async for line in r.content:
                        if not line.strip():
                            continue
                        if first is None and line.startswith(b"data: {"):
                            first = time.perf_counter() - start
                        broken |= line.startswith(b'data: {"error"')
                        last = line.strip()
                    if r.status == 200 and first is not None and last == b"data: [DONE]" and not broken:
                        self.stats.ok += 1
                        self.stats.ttft_s.append(first)
                    else:
                        self.stats.failures.append(f"HTTP {r.status}: {last[:200]!r}")
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                self.stats.failures.append(f"{type(e).__name__}: {e}")
            if self.think_s:
                await asyncio.sleep(self.think_s)
