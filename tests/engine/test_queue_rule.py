"""The queue rule of engine/serve/admission.py: slots from the engine's batch, a queue bounded by the
estimated wait (not a count), Retry-After that is that estimate. A handler with known timings
stands in for the engine, so the estimates can be checked against what really happened."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from kiln.engine.serve.admission import ARRIVAL, MIN_SAMPLES, SERVE_ADMISSION, STATS, Admission, AdmissionConfig

FIRST_S = 0.05  # slot to first token
HOLD_S = 0.5  # slot to last token


async def _serve(admission: Admission):
    async def generate(request: web.Request) -> web.Response:
        await asyncio.sleep(FIRST_S)
        request[STATS]["ttft_ms"] = (time.perf_counter() - request[ARRIVAL]) * 1000
        await asyncio.sleep(HOLD_S - FIRST_S)
        return web.json_response({"queue_ms": request[STATS]["queue_ms"]})

    app = web.Application(middlewares=[admission.middleware])
    app.router.add_post("/v1/completions", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"


async def _one(s: aiohttp.ClientSession, url: str) -> tuple[int, str | None, float | None]:
    async with s.post(url, json={}) as r:
        body = await r.json()
        return r.status, r.headers.get("Retry-After"), body.get("queue_ms")


async def _burst(admission: Admission, n: int) -> list[tuple[int, str | None, float | None]]:
    """MIN_SAMPLES requests one slot-batch at a time (the measurements), then `n` at once."""
    runner, url = await _serve(admission)
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(0, MIN_SAMPLES, admission.slots):
                await asyncio.gather(*(_one(s, url) for _ in range(admission.slots)))
            return await asyncio.gather(*(_one(s, url) for _ in range(n)))
    finally:
        await runner.cleanup()


def test_serve_defaults_take_slots_from_the_engine_batch():
    admission = Admission(SERVE_ADMISSION)
    admission.size(8)
    assert (admission.slots, admission.queue_cap) == (8, 8)
    admission.size(None)  # an engine with no batch bound
    assert admission.slots == 32
    explicit = Admission(SERVE_ADMISSION.model_copy(update={"max_concurrency": 3, "max_queue": 0}))
    explicit.size(8)
    assert (explicit.slots, explicit.queue_cap) == (3, 0)


def test_auto_budget_refuses_a_wait_longer_than_half_the_time_to_first_token():
    # 2 slots held 0.5 s each, both just taken: the first in line would wait ~0.5 s, far over
    # 0.5 x 0.05 s.
    admission = Admission(AdmissionConfig(max_concurrency=2, max_queue=8, max_queue_wait_s="auto"))
    results = asyncio.run(_burst(admission, 6))
    assert sorted(r[0] for r in results) == [200, 200, 429, 429, 429, 429]
    assert 0.9 * HOLD_S <= admission.clock.wait(3, 2, [], 0.0) <= 1.3 * HOLD_S  # measured, not configured
    assert admission.budget() < 0.5 * 2 * FIRST_S


def test_a_ttft_objective_queues_what_it_leaves():
    # Objective 700 ms less ~50 ms to first token leaves ~0.65 s: the two first in line (~0.5 s,
    # for the two slots just taken) wait, the third (~1 s, a second round) does not.
    admission = Admission(AdmissionConfig(max_concurrency=2, max_queue=8, max_queue_wait_s="auto", ttft_slo_ms=700))
    results = asyncio.run(_burst(admission, 6))
    assert sorted(r[0] for r in results) == [200, 200, 200, 200, 429, 429]
    queued = [r[2] for r in results if r[0] == 200 and r[2] > 50]
    assert len(queued) == 2 and all(0.4 < q / 1000 < 0.65 for q in queued)  # they waited about the estimate


def test_retry_after_is_the_estimated_wait_and_queued_waits_match_it():
    # One slot, a queue of 3 by count: positions 1-3 wait ~0.5, 1.0, 1.5 s; the refused 4th would
    # have waited ~2 s, which is its Retry-After (not the configured 1 s).
    admission = Admission(AdmissionConfig(max_concurrency=1, max_queue=3, retry_after_s=1))
    results = asyncio.run(_burst(admission, 5))
    served = sorted(r[2] for r in results if r[0] == 200)
    refused = [r for r in results if r[0] == 429]
    assert len(served) == 4 and len(refused) == 1
    assert refused[0][1] == "2"
    for position, waited_ms in enumerate(served[1:], start=1):
        assert abs(waited_ms / 1000 - position * HOLD_S) < 0.3 * position * HOLD_S, served


def test_before_any_measurement_the_count_bound_and_configured_retry_after_apply():
    admission = Admission(AdmissionConfig(max_concurrency=1, max_queue=1, max_queue_wait_s="auto", retry_after_s=3))

    async def main():
        runner, url = await _serve(admission)
        try:
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(_one(s, url) for _ in range(3)))
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    assert sorted(r[0] for r in results) == [200, 200, 429]
    assert [r[1] for r in results if r[0] == 429] == ["3"]
