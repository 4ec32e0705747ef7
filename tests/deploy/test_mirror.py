"""Mirroring never harms users: mirrored requests carry no client identity, are dropped first under
load, and never change what the client receives. The router runs as a real process in front of
fake engines and a recording server that plays the canary."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest
from aiohttp import web

from kiln.deploy.config import RouterConfig
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve import metric_names as names
from kiln.engine.serve.admission import AdmissionConfig
from kiln.engine.serve.fake import FakeServer
from tests.deploy.fakes import fake
from tests.deploy.test_router import body, post_all


class Recorder:
    """An OpenAI-ish server on a thread that records every request and answers `text`; with
    `hold`, it answers nothing until the connection is dropped (a mirror that never ends)."""

    def __init__(self, text: str = " tok tok", hold: bool = False):
        self.text, self.hold = text, hold
        self.seen: list[tuple[dict[str, str], dict]] = []
        self.cancelled = 0
        self.url = ""
        self._ready = threading.Event()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((dict(request.headers), await request.json()))
        if self.hold:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return web.json_response({"id": "x", "object": "text_completion", "model": "recorder",
                                  "choices": [{"index": 0, "text": self.text, "finish_reason": "length"}]})

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> Recorder:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _wait_for(predicate, what: str, tries: int = 200) -> None:
    import time

    for _ in range(tries):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


def _dropped(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(names.total(names.ROUTER_MIRROR_DROPPED) + "{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_mirrors_carry_no_client_identity():
    with FakeServer(fake(ttft_ms=5, tpot_ms=2)) as s, Recorder() as canary:
        config = RouterConfig(port=0, stable_url=s.url, canary_url=canary.url, weight=0, mirror_fraction=1.0)
        client = {"Authorization": "Bearer the-clients-own-key", "X-Session-Id": "alice-session"}
        with RouterProcess(config) as r:
            bodies = [body(i, stream=i % 2 == 0, temperature=0, user="alice", metadata={"who": "alice"})
                      for i in range(6)]
            assert [st for st, _ in post_all(r.url, bodies, [client] * 6)] == [200] * 6
            _wait_for(lambda: len(canary.seen) == 6, "six mirrors at the canary")
        with RouterProcess(config, upstream_api_key="router-key") as r:
            assert post_all(r.url, [bodies[0]], [client])[0][0] == 200
            _wait_for(lambda: len(canary.seen) == 7, "a seventh mirror")
    for headers, sent in canary.seen:
        assert "user" not in sent and "metadata" not in sent and "stream" not in sent, sent
        assert sent["prompt"].startswith("prompt number") and sent["temperature"] == 0
        assert not any(k.lower() == "x-session-id" for k in headers), headers
    assert [h.get("Authorization") for h, _ in canary.seen] == [None] * 6 + ["Bearer router-key"]


def _answers(raw: list[tuple[int, bytes]]) -> list[tuple[int, list]]:
    """Status and content of each answer, without the per-response id and timestamp."""
    def clean(obj: dict) -> dict:
        return {k: v for k, v in obj.items() if k not in ("id", "created")}
    out = []
    for status, data in raw:
        if data.startswith(b"data:"):
            events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e.strip()]
            out.append((status, [e.decode() if e == b"[DONE]" else clean(json.loads(e)) for e in events]))
        else:
            out.append((status, [clean(json.loads(data))]))
    return out


@pytest.mark.parametrize("canary", ["disagrees", "fails", "never answers"])
def test_mirroring_never_changes_what_the_client_receives(canary):
    """The same requests, through a router that mirrors every one to a canary that disagrees,
    fails (HTTP 500) or never answers, get exactly what a router that mirrors nothing gives."""
    bodies = [body(i, stream=i % 2 == 0, tokens=5, temperature=0, user=f"u{i}") for i in range(12)]
    with FakeServer(fake(ttft_ms=5, tpot_ms=2)) as s:
        with RouterProcess(RouterConfig(port=0, stable_url=s.url)) as plain:
            want = _answers(post_all(plain.url, bodies))
        other = {"disagrees": lambda: Recorder(text=" something else"), "fails": lambda: FakeServer(fake(error_rate=1.0)),
                 "never answers": lambda: Recorder(hold=True)}[canary]
        with other() as c, RouterProcess(RouterConfig(port=0, stable_url=s.url, canary_url=c.url, weight=0,
                                                      mirror_fraction=1.0)) as r:
            got = _answers(post_all(r.url, bodies))
            if canary == "disagrees":
                _wait_for(lambda: len(r.observations()["comparisons"]) == 12, "twelve comparisons")
                assert {x["match"] for x in r.observations()["comparisons"]} == {0.0}
            arms = [o["arm"] for o in r.observations()["observations"]]
    assert got == want
    assert arms == ["stable"] * 12  # a mirror is not client traffic: no observation of either arm


def test_mirrors_are_dropped_first_under_load():
    """Two slots. Mirrors start only while clients leave slots free, and a client that would wait
    for a slot cancels every mirror in flight; no client is refused or delayed by one."""
    with FakeServer(fake(ttft_ms=5, tpot_ms=40)) as s, Recorder(hold=True) as canary:
        config = RouterConfig(port=0, stable_url=s.url, canary_url=canary.url, weight=0, mirror_fraction=1.0,
                              admission=AdmissionConfig(max_concurrency=2, max_queue=16))
        with RouterProcess(config) as r:
            for i in range(3):  # one at a time: two mirrors fit beside one client, the third does not
                assert post_all(r.url, [body(i, stream=False, tokens=2, temperature=0)])[0][0] == 200
            _wait_for(lambda: len(canary.seen) == 2, "two mirrors held at the canary")
            assert _dropped(r.url)[names.MIRROR_LOAD] == 1
            # three clients at once for two slots: the third waits, and the two held mirrors go first
            results = post_all(r.url, [body(i, stream=False, tokens=10) for i in range(3)])
            assert [st for st, _ in results] == [200] * 3
            _wait_for(lambda: canary.cancelled == 2, "the held mirrors cancelled")
            assert _dropped(r.url)[names.MIRROR_LOAD] == 3
            assert r.observations()["comparisons"] == []
