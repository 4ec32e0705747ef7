"""The `remote` backend: an engine that already runs elsewhere, reached over the OpenAI API.

A recipe can point at trtllm-serve, vLLM, another `kiln serve` or a production URL instead of
building an engine. Generation streams `/v1/completions` with token-ID prompts; scoring uses
echo + logprobs exactly like lm-eval's `local-completions`. The API key is read from the
environment variable the recipe names, never from the recipe itself.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from kiln.engine.base import BACKENDS, Engine, EngineBackend, EngineConfig, GenerationRequest, Score, TokenEvent
from kiln.core.errors import BadInput, KilnError


def free_port() -> int:
    """A free TCP port on the loopback interface, for a server kiln starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen | None, grace_s: float) -> None:
    """Stop a server kiln started: SIGTERM, then SIGKILL if it has not exited within `grace_s` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)


def wait_healthy(url: str, timeout_s: float, process: subprocess.Popen | None = None, name: str = "server",
                 log: Any = None, poll_s: float = 0.2) -> None:
    """Return once GET `url`/health answers 200. KilnError if `process` exits first (with the
    tail of its `log` file, when given) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            tail = ""
            if log is not None:
                log.seek(0)
                tail = ":\n" + log.read().decode(errors="replace")[-1500:]
            raise KilnError(f"{name} at {url} exited with code {process.returncode} before it was healthy{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise KilnError(f"{name} at {url} was not healthy (GET /health 200) within {timeout_s:g} s")


class RemoteEngineConfig(EngineConfig):
    backend: Literal["remote"] = "remote"
    url: str = Field(description="base URL of the OpenAI API, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="model name the endpoint serves")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="name of the environment variable holding the key")
    tokenizer: str | None = Field(None, description="tokenizer folder; default: the source checkpoint")
    stream_token_ids: bool = Field(True, description="ask for token ids while streaming (vLLM's "
                                   "return_tokens_as_token_ids); off: re-tokenize the streamed text")
    score_batch: int = Field(16, ge=1, description="prompts per scoring request")
    timeout_s: float = Field(600, gt=0)

    @field_validator("url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        v = v.rstrip("/")
        return v if v.endswith("/v1") else v + "/v1"


@BACKENDS.register("remote", RemoteEngineConfig)
class RemoteBackend(EngineBackend):
    libraries: ClassVar[tuple[str, ...]] = ("aiohttp",)
    hardware_bound: ClassVar[bool] = False  # the endpoint's hardware is not this machine's

    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        tokenizer = self.config.tokenizer or str(checkpoint)
        return {"url": self.config.url, "model": self.config.model, "tokenizer": tokenizer}

    @classmethod
    def open(cls, engine_dir: Path, config: RemoteEngineConfig, manifest: dict[str, Any]) -> RemoteEngine:
        return RemoteEngine(config, manifest["build"]["tokenizer"])


@dataclass(frozen=True)
class _Failed:
    seq_id: int
    error: Exception


class RemoteEngine(Engine):
    """Engine over HTTP. A private event loop thread runs the streams; `step` collects tokens."""

    def __init__(self, config: RemoteEngineConfig, tokenizer: str | Path, api_key: str | None = None):
        from transformers import AutoTokenizer

        self.config = config
        self.manifest = {"backend": "remote", "config": config.model_dump(mode="json")}
        if api_key is None and config.api_key_env:
            api_key = os.environ.get(config.api_key_env)
            if api_key is None:
                raise BadInput(f"api_key_env: environment variable {config.api_key_env} is not set. "
                               "Export it with the endpoint's API key.")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self._ids = itertools.count()
        self._events: queue.SimpleQueue[TokenEvent | _Failed] = queue.SimpleQueue()
        self._active: dict[int, Any] = {}  # seq id -> concurrent future of its stream
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="kiln-remote", daemon=True).start()
        self._session = self._run(self._open())

    async def _open(self):
        import aiohttp

        return aiohttp.ClientSession(headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        seq_id = next(self._ids)
        self._active[seq_id] = asyncio.run_coroutine_threadsafe(self._stream(seq_id, request), self._loop)
        return seq_id

    def has_work(self) -> bool:
        return bool(self._active)

    def cancel(self, seq_id: int) -> None:
        future = self._active.pop(seq_id, None)
        if future is not None:
            future.cancel()  # closes the connection; the server cancels the sequence

    def step(self) -> list[TokenEvent]:
        """Wait for at least one token from any active stream, then return all that arrived."""
        out: list[TokenEvent] = []
        item = self._events.get(timeout=self.config.timeout_s) if self._active else None
        while item is not None:
            if isinstance(item, _Failed):
                self._active.pop(item.seq_id, None)
                raise item.error
            if item.seq_id in self._active:
                out.append(item)
                if item.finish_reason is not None:
                    self._active.pop(item.seq_id)
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                item = None
        return out

    async def _stream(self, seq_id: int, r: GenerationRequest) -> None:
        body: dict[str, Any] = {"model": self.config.model, "prompt": r.prompt_ids, "stream": True,
                                "max_tokens": r.max_new_tokens, "temperature": r.temperature,
                                "ignore_eos": r.ignore_eos}
        if r.seed is not None:
            body["seed"] = r.seed
        if r.top_p < 1:
            body["top_p"] = r.top_p
        if r.stop_ids:
            body["stop_token_ids"] = list(r.stop_ids)
        if self.config.stream_token_ids:
            body |= {"logprobs": 0, "return_tokens_as_token_ids": True}
        try:
            async with self._session.post(f"{self.config.url}/completions", json=body) as resp:
                await _check(resp)
                async for line in resp.content:
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    for choice in json.loads(line[5:]).get("choices", []):
                        self._emit(seq_id, choice, time.perf_counter())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surface it from step() on the caller's thread
            self._events.put(_Failed(seq_id, e))

    def _emit(self, seq_id: int, choice: dict, now: float) -> None:
        lp = choice.get("logprobs") or {}
        if choice.get("token_ids") is not None:  # TensorRT-LLM returns them on every choice
            ids = list(choice["token_ids"])
        elif lp.get("tokens") and all(t.startswith("token_id:") for t in lp["tokens"]):
            ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        else:  # the server gave only text: re-derive tokens (counts may differ slightly)
            ids = self.tokenizer(choice.get("text", ""), add_special_tokens=False).input_ids
        finish = choice.get("finish_reason")
        if finish and not ids:  # a final chunk with no new text still ends the sequence
            ids = [self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0]
        for k, token in enumerate(ids):
            self._events.put(TokenEvent(seq_id, token, now, None, finish if k == len(ids) - 1 else None))

    # ----- scoring --------------------------------------------------------------------------

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        if any(not ctx or not cont for ctx, cont in pairs):
            raise BadInput("score() needs a non-empty context and continuation in every pair.")
        chunks = [list(pairs[i : i + self.config.score_batch]) for i in range(0, len(pairs), self.config.score_batch)]

        async def all_chunks():
            return await asyncio.gather(*(self._score(c) for c in chunks))

        return [s for chunk in self._run(all_chunks()) for s in chunk]

    async def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[Score]:
        # max_tokens=1 as lm-eval sends it: not every server accepts 0 with echo.
        body = {"model": self.config.model, "prompt": [list(c) + list(x) for c, x in pairs], "max_tokens": 1,
                "temperature": 0, "echo": True, "logprobs": 1}
        async with self._session.post(f"{self.config.url}/completions", json=body) as resp:
            await _check(resp)
            data = await resp.json()
        out = []
        for choice, (ctx, cont) in zip(sorted(data["choices"], key=lambda c: c["index"]), pairs, strict=True):
            lps = choice["logprobs"]["token_logprobs"][len(ctx) : len(ctx) + len(cont)]
            tops = choice["logprobs"]["top_logprobs"][len(ctx) : len(ctx) + len(cont)]
            greedy = all(lp >= max(top.values()) for lp, top in zip(lps, tops, strict=True))
            out.append(Score(float(sum(lps)), greedy, tuple(float(x) for x in lps)))
        return out

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        raise BadInput("A remote endpoint returns only top-k logprobs, not full distributions: "
                       "token-level agreement (KL, top-1) needs a local engine of the same checkpoint.")

    def close(self) -> None:
        for seq_id in list(self._active):
            self.cancel(seq_id)
        if self._loop.is_running():
            self._run(self._shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)

    async def _shutdown(self) -> None:
        """A stream whose last token has arrived is no longer active but may still be reading the server's
        `[DONE]`: every stream is cancelled and awaited here, so none is pending when the loop stops (asyncio
        printed "Task was destroyed but it is pending!" into the run's console)."""
        streams = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await self._session.close()


async def _check(resp) -> None:
    if resp.status >= 400:
        text = (await resp.text())[:500]
        if resp.status in (400, 401, 403, 404, 422):
            raise BadInput(f"Endpoint {resp.url} refused the request ({resp.status}): {text}")
        raise RuntimeError(f"Endpoint {resp.url} failed ({resp.status}): {text}")
