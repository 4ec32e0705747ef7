"""Admission control: fast 429 with Retry-After, per-tenant rate limits, request logs, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import aiohttp
import pytest
from aiohttp import web

from kiln.deploy.config import RouterConfig
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve.admission import STATS, Admission, AdmissionConfig
from kiln.engine.serve.fake import FakeServer
from tests.deploy.fakes import fake


async def _serve(admission: Admission, hold_s: float) -> tuple[web.AppRunner, str]:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(hold_s)
        request[STATS].update(ttft_ms=12.5, tokens_out=3)
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        status, body = admission.health()
        return web.json_response(body, status=status)

    app = web.Application(middlewares=[admission.middleware])
    app.router.add_post("/v1/completions", slow)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_full_queue_answers_429_with_retry_after_at_once():
    async def main() -> None:
        admission = Admission(AdmissionConfig(max_concurrency=2, max_queue=2, retry_after_s=3))
        runner, url = await _serve(admission, hold_s=0.5)
        try:
            async with aiohttp.ClientSession() as s:
                async def one() -> tuple[int, str | None, float]:
                    start = time.perf_counter()
                    async with s.post(url + "/v1/completions", json={}) as r:
                        await r.read()
                        return r.status, r.headers.get("Retry-After"), time.perf_counter() - start
                results = await asyncio.gather(*(one() for _ in range(8)))
        finally:
            await runner.cleanup()
        ok = [r for r in results if r[0] == 200]
        rejected = [r for r in results if r[0] == 429]
        assert len(ok) == 4 and len(rejected) == 4  # 2 running + 2 queued; the rest refused
        assert all(r[1] == "3" and r[2] < 0.3 for r in rejected)  # fast, not after the 0.5 s hold
        assert admission.rejected["queue_full"] == 4

    asyncio.run(main())


def test_rate_limit_is_per_tenant():
    async def main() -> None:
        admission = Admission(AdmissionConfig(rate_limit_rps=0.5, rate_limit_burst=2))
        runner, url = await _serve(admission, hold_s=0)
        try:
            async with aiohttp.ClientSession() as s:
                async def one(key: str) -> tuple[int, str | None]:
                    async with s.post(url + "/v1/completions", json={}, headers={"Authorization": f"Bearer {key}"}) as r:
                        return r.status, r.headers.get("Retry-After")
                alice = [await one("alice") for _ in range(3)]
                bob = [await one("bob") for _ in range(2)]
        finally:
            await runner.cleanup()
        assert [a[0] for a in alice] == [200, 200, 429] and alice[2][1] == "2"  # 1 token at 0.5/s: 2 s
        assert [b[0] for b in bob] == [200, 200]  # another tenant keeps its own bucket

    asyncio.run(main())


def test_one_json_log_line_per_request(caplog):
    async def main() -> None:
        admission = Admission(AdmissionConfig())
        runner, url = await _serve(admission, hold_s=0)
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    async with s.post(url + "/v1/completions", json={}, headers={"Authorization": "Bearer k1"}) as r:
                        assert r.status == 200
                async with s.get(url + "/health") as r:  # not a guarded path: no log line
                    assert r.status == 200
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="kiln.requests"):
        asyncio.run(main())
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kiln.requests"]
    assert len(lines) == 3
    assert {"queue_ms", "ttft_ms", "tpot_ms", "tokens_in", "tokens_out", "status", "tenant", "e2e_ms"} <= set(lines[0])
    assert lines[0]["ttft_ms"] == 12.5 and lines[0]["tokens_out"] == 3 and lines[0]["status"] == 200
    assert "k1" not in lines[0]["tenant"]  # a hash of the key, never the key


@pytest.mark.timeout(120)
def test_sigterm_drains_in_flight_streams_then_exits(tmp_path):
    log = tmp_path / "router.log"
    with FakeServer(fake(ttft_ms=10, tpot_ms=40)) as s:
        proc = RouterProcess(RouterConfig(port=0, stable_url=s.url), log_path=str(log)).__enter__()
        try:
            async def main() -> tuple[list[bytes], int]:
                async with aiohttp.ClientSession() as session:
                    async with session.post(proc.url + "/v1/completions",
                                            json={"prompt": "x", "max_tokens": 30, "stream": True}) as r:
                        lines = [await r.content.readline()]  # first token is out: the stream is in flight
                        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                        await asyncio.sleep(0.2)
                        async with session.post(proc.url + "/v1/completions", json={"prompt": "y"}) as late:
                            late_status = late.status
                        lines += [line async for line in r.content]
                        return lines, late_status

            lines, late_status = asyncio.run(main())
            assert late_status == 503  # draining: no new work
            events = [x.strip() for x in lines if x.strip()]
            assert events[-1] == b"data: [DONE]" and len(events) == 31  # the in-flight stream finished
            assert proc.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
        finally:
            proc.stop()
    assert '"event": "drained", "clean": true' in log.read_text()


@pytest.mark.timeout(120)
def test_sigterm_exit_is_bounded_by_the_drain_timeout():
    """A stream longer than the drain: the router exits about a second after drain_timeout_s
    (measured 1.68 s with a 1 s drain; it waited aiohttp's 60 s shutdown timeout before), and
    the stream it cut ends with an error event and [DONE], not a dropped connection."""
    from kiln.engine.serve.admission import CUT_AFTER_DRAIN_S

    drain = 1.0
    with FakeServer(fake(ttft_ms=10, tpot_ms=200)) as s:  # 100 tokens: a 20 s stream
        config = RouterConfig(port=0, stable_url=s.url, admission=AdmissionConfig(drain_timeout_s=drain))
        proc = RouterProcess(config).__enter__()
        try:
            async def main() -> tuple[float, list[bytes]]:
                async with aiohttp.ClientSession() as session:
                    async with session.post(proc.url + "/v1/completions",
                                            json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
                        await r.content.readline()  # in flight
                        start = time.monotonic()
                        proc.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                        rest = [line.strip() async for line in r.content if line.strip()]
                        await asyncio.get_running_loop().run_in_executor(None, proc.proc.wait, 60)
                        return time.monotonic() - start, rest

            seconds, rest = asyncio.run(main())
        finally:
            proc.stop()
    print(f"router exited {seconds:.2f} s after SIGTERM (drain {drain:g} s, cut {CUT_AFTER_DRAIN_S:g} s)")
    assert drain <= seconds < drain + CUT_AFTER_DRAIN_S + 1.5
    assert rest[-1] == b"data: [DONE]" and len(rest) < 100  # cut, not finished
    assert json.loads(rest[-2].removeprefix(b"data: "))["error"]["type"] == "service_unavailable"


def test_every_request_is_counted_by_outcome():
    from prometheus_client import CollectorRegistry, generate_latest

    from kiln.engine.serve import metric_names as names

    async def main() -> str:
        admission = Admission(AdmissionConfig(max_concurrency=1, max_queue=0))
        registry = CollectorRegistry()
        admission.export(registry, names.ADMISSION, count_requests=True)

        async def answer(request: web.Request) -> web.StreamResponse:
            kind = request.query.get("kind")
            if kind == "slow":
                await asyncio.sleep(0.3)
            if kind == "forever":  # the client gives up first
                await asyncio.sleep(30)
            if kind == "bad":
                return web.json_response({}, status=400)
            if kind == "boom":
                return web.json_response({}, status=500)
            if kind == "midstream":  # a 200 whose stream ended in an error event
                request[STATS]["error"] = "internal_error: engine died"
            return web.json_response({})

        app = web.Application(middlewares=[admission.middleware])
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:
                async def one(kind: str) -> int:
                    async with s.post(url, params={"kind": kind}, json={}) as r:
                        return r.status
                assert [await one(k) for k in ("ok", "ok", "bad", "boom", "midstream")] == [200, 200, 400, 500, 200]
                slow = asyncio.create_task(one("slow"))
                await asyncio.sleep(0.1)
                assert await one("ok") == 429  # the one slot is taken, no queue
                await slow
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(one("forever"), 0.2)
                for _ in range(50):  # the server sees the disconnect and cancels the handler
                    if admission.running == 0:
                        break
                    await asyncio.sleep(0.02)
        finally:
            await runner.cleanup()
        return generate_latest(registry).decode()

    text = asyncio.run(main())
    counts = {o: next(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith(f'{names.total(names.REQUESTS)}{{{names.OUTCOME}="{o}"}}'))
              for o in names.OUTCOMES}
    assert counts == {"success": 3.0, "client_error": 1.0, "server_error": 2.0, "rejected": 1.0, "cancelled": 1.0}
