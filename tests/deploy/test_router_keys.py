"""The router's keys, as an attacker would try them (issue 52, "no open doors"): a client's credentials never
reach a backend, /admin is never open, and the local canary's own admin key travels only in its router's
environment. The router runs as a real process; the backends are a real fake engine and a small recording
server on 127.0.0.1 that answers like an engine and keeps every header it was sent."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from kiln.core.errors import BadInput
from kiln.deploy.config import RouterConfig
from kiln.deploy.local import BackendSpec, LocalTarget
from kiln.deploy.router import Router
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve.fake import FakeServer
from tests.deploy.fakes import fake
from tests.deploy.test_router import body, post_all

REPO = Path(__file__).parents[2]
CLIENT_KEY = "the-clients-own-key"


class Backend:
    """An engine-shaped server on a thread: answers completions (JSON or one SSE event) and /v1/models,
    and records the headers of every request it gets."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._ready = threading.Event()

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        choice = {"index": 0, "text": " tok", "finish_reason": "length"}
        if not (await request.json()).get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "model": "b", "choices": [choice]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = {"id": "x", "object": "text_completion", "model": "b", "choices": [choice]}
        await resp.write(f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        self.headers.append(dict(request.headers))
        return web.json_response({"object": "list", "data": [{"id": "b", "object": "model"}]})

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.url = "http://127.0.0.1:%d" % self.runner.addresses[0][1]
        self._ready.set()
        self.loop.run_forever()

    def __enter__(self) -> Backend:
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def authorizations(self) -> list[str | None]:
        return [h.get("Authorization") for h in self.headers]


def _get(url: str, key: str | None = None, method: str = "GET", data: dict | None = None) -> int:
    req = urllib.request.Request(url, method=method, data=json.dumps(data).encode() if data is not None else None,
                                 headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_clients_key_never_reaches_a_backend():
    """Today's router passed the client's Authorization on when it had no upstream key: every backend
    (and whoever runs or logs it) learnt the client's key, and a backend sharing that key was opened by it."""
    with Backend() as stable, Backend() as canary:
        config = RouterConfig(port=0, stable_url=stable.url, canary_url=canary.url, weight=50, affinity="random")
        with RouterProcess(config, api_key=CLIENT_KEY) as r:
            sent = post_all(r.url, [body(i, stream=i % 2 == 0) for i in range(8)], key=CLIENT_KEY)
            assert [st for st, _ in sent] == [200] * 8
            assert _get(r.url + "/v1/models", CLIENT_KEY) == 200
        seen = stable.authorizations() + canary.authorizations()
        assert len(seen) == 9 and seen == [None] * 9, seen
        stable.headers.clear()
        canary.headers.clear()
        with RouterProcess(config, api_key=CLIENT_KEY, upstream_api_key="the-routers-key") as r:
            assert post_all(r.url, [body(0, stream=False), body(1)], key=CLIENT_KEY)[0][0] == 200
            assert _get(r.url + "/v1/models", CLIENT_KEY) == 200
        assert stable.authorizations() + canary.authorizations() == ["Bearer the-routers-key"] * 3


def test_a_router_with_no_client_key_keeps_admin_closed():
    """Today a router with no API key let anyone move the canary's weight or point an arm at their own
    server (/admin/backends). Now /admin needs a key whatever the client side does."""
    with FakeServer(fake(ttft_ms=5, tpot_ms=2)) as s, Backend() as elsewhere:
        with RouterProcess(RouterConfig(port=0, stable_url=s.url)) as r:  # no client key, as `kiln route` on loopback
            assert post_all(r.url, [body(0, stream=False)])[0][0] == 200  # clients need none
            assert _get(r.url + "/admin/state") == 401
            assert _get(r.url + "/admin/backends", method="POST", data={"stable_url": elsewhere.url}) == 401
            assert _get(r.url + "/admin/weight", CLIENT_KEY, "POST", {"weight": 0}) == 401  # not just any key
            assert r.state()["stable_url"] == s.url  # only the process that started it holds its admin key
            assert _get(r.url + "/health") == 200 and _get(r.url + "/metrics") == 200
        assert elsewhere.headers == []


def test_kiln_route_admin_needs_the_admin_key_and_is_closed_without_one(tmp_path):
    with FakeServer(fake(ttft_ms=5, tpot_ms=2)) as s:
        for env, admin in (({}, None), ({"KILN_ADMIN_KEY": "admin-key"}, "admin-key")):
            proc, url = _kiln_route(s.url, env)
            try:
                assert post_all(url, [body(0, stream=False)])[0][0] == 200
                assert _get(url + "/admin/state") == 401
                assert _get(url + "/admin/state", "some-guess") == 401
                if admin:
                    assert _get(url + "/admin/state", admin) == 200
            finally:
                proc.terminate()
                proc.wait(30)
            log = proc.stderr.read()
            assert ("/admin closed" in log) == (admin is None), log


def _kiln_route(stable: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    clean = {k: v for k, v in os.environ.items() if k not in ("KILN_API_KEY", "KILN_ADMIN_KEY")}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "route", "--stable", stable, "--port", str(port)],
                            cwd=REPO, env={**clean, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("KILN_ROUTER_READY"), proc.stderr.read() if proc.poll() else ""
    return proc, f"http://127.0.0.1:{port}"


def test_the_local_canary_drives_admin_with_a_key_only_its_router_knows():
    with LocalTarget(BackendSpec(fake=fake(ttft_ms=5, tpot_ms=2)), BackendSpec(fake=fake(ttft_ms=5, tpot_ms=2))) as t:
        t.set_traffic(50)  # through /admin, with its own key
        assert t.router.state()["weight"] == 50
        assert _get(t.url + "/admin/weight", method="POST", data={"weight": 0}) == 401
        pid, key = t.router.proc.pid, t.router.admin_key.encode()
        assert key not in Path(f"/proc/{pid}/cmdline").read_bytes()  # never in argv, where `ps` shows it
        assert key in Path(f"/proc/{pid}/environ").read_bytes()
        t.rollback()
        assert t.router.state()["weight"] == 0


@pytest.mark.parametrize("blank", [",", " ", "", "a,,"])
def test_a_router_refuses_a_key_that_strips_to_nothing(blank):
    config = RouterConfig(port=0, stable_url="http://127.0.0.1:9")
    for make in (lambda: Router(config, api_key=blank), lambda: Router(config, admin_key=blank),
                 lambda: Router(config, upstream_api_key=blank), lambda: RouterProcess(config, api_key=blank),
                 lambda: LocalTarget(BackendSpec(url="http://127.0.0.1:9"), BackendSpec(url="http://127.0.0.1:9"),
                                     api_key=blank)):
        with pytest.raises(BadInput, match="empty API key"):
            make()
