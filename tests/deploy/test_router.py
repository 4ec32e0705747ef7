"""The router against real fake-engine processes: split, stickiness, streaming, failover, auth."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections import Counter

import aiohttp
import pytest

from kiln.deploy.config import RouterConfig
from kiln.deploy.loadgen import SteadyLoad
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve.fake import FakeServer
from tests.deploy.fakes import fake


async def _post_all(url: str, bodies: list[dict], headers: list[dict] | None = None,
                    key: str | None = None) -> list[tuple[int, bytes]]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=auth) as s:
        async def one(i: int, body: dict) -> tuple[int, bytes]:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            async with s.post(url + path, json=body, headers=(headers or [{}] * len(bodies))[i]) as r:
                return r.status, await r.read()
        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def post_all(url, bodies, headers=None, key=None):
    return asyncio.run(_post_all(url, bodies, headers, key))


def body(i: int = 0, stream: bool = True, tokens: int = 4, **extra) -> dict:
    return {"model": "m", "prompt": f"prompt number {i}", "max_tokens": tokens, "stream": stream, **extra}


@pytest.fixture
def pair():
    """Stable and canary fake engines, told apart by their model names."""
    with FakeServer(fake(ttft_ms=5, tpot_ms=2, model="stable-model")) as s, \
            FakeServer(fake(ttft_ms=5, tpot_ms=2, model="canary-model")) as c:
        yield s, c


def router(stable, canary, **options) -> RouterProcess:
    return RouterProcess(RouterConfig(port=0, stable_url=stable.url, canary_url=canary.url if canary else None, **options))


def test_random_split_follows_the_weight_and_changes_at_runtime(pair):
    s, c = pair
    with router(s, c, affinity="random", weight=30) as r:
        results = post_all(r.url, [body(i, stream=False, tokens=1) for i in range(400)])
        models = Counter(json.loads(b)["model"] for _, b in results)
        assert models["canary-model"] + models["stable-model"] == 400
        assert 0.22 < models["canary-model"] / 400 < 0.38  # binomial(400, 0.3): +-4 sd
        r.set_weight(0)
        results = post_all(r.url, [body(i, stream=False, tokens=1) for i in range(50)])
        assert {json.loads(b)["model"] for _, b in results} == {"stable-model"}


def test_sessions_stick_to_one_arm(pair):
    s, c = pair
    with router(s, c, weight=50) as r:
        bodies = [body(i, stream=False, tokens=1) for i in range(200)]
        headers = [{"X-Session-Id": f"user-{i % 40}"} for i in range(200)]
        arms: dict[str, set] = {}
        for (status, raw), h in zip(post_all(r.url, bodies, headers), headers, strict=True):
            assert status == 200
            arms.setdefault(h["X-Session-Id"], set()).add(json.loads(raw)["model"])
        assert all(len(v) == 1 for v in arms.values())
        assert len({next(iter(v)) for v in arms.values()}) == 2  # both arms got sessions
        # The OpenAI `user` field works as the session key too.
        results = post_all(r.url, [body(i, stream=False, tokens=1, user="alice") for i in range(20)])
        assert len({json.loads(raw)["model"] for _, raw in results}) == 1


def test_stream_passes_through_event_by_event():
    with FakeServer(fake(ttft_ms=20, tpot_ms=60)) as s, router(s, None) as r:
        async def read() -> tuple[list[float], list[bytes]]:
            async with aiohttp.ClientSession() as session:
                start = time.perf_counter()
                async with session.post(r.url + "/v1/completions", json=body(tokens=6)) as resp:
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    times, events = [], []
                    async for line in resp.content:
                        if line.strip():
                            times.append(time.perf_counter() - start)
                            events.append(line.strip())
                    return times, events

        times, events = asyncio.run(read())
        assert events[-1] == b"data: [DONE]" and len(events) == 7  # 6 tokens, no usage chunk (not asked)
        assert times[0] < 0.25  # first token long before the 0.32 s the whole stream takes
        assert times[5] - times[0] > 0.2  # tokens arrived spread out, not buffered
        # Asked for usage: it comes through.
        status, raw = post_all(r.url, [body(tokens=3, stream_options={"include_usage": True})])[0]
        assert b'"usage"' in raw and status == 200


def test_canary_failing_before_first_token_is_retried_on_stable():
    with FakeServer(fake(ttft_ms=5, tpot_ms=2)) as s, FakeServer(fake(error_rate=1.0)) as c, \
            router(s, c, affinity="random", weight=50) as r:
        bodies = [body(i) for i in range(60)] + [body(i, stream=False) for i in range(20)]
        results = post_all(r.url, bodies)
        assert [st for st, _ in results] == [200] * 80  # zero client failures
        assert all(raw.rstrip().endswith(b"[DONE]") for _, raw in results[:60])
        obs = r.observations()["observations"]
        canary = [o for o in obs if o["arm"] == "canary"]
        assert canary and all(o["status"] == 500 and o["retried"] for o in canary)
        assert sum(o["arm"] == "stable" and o["error"] is None for o in obs) == 80
        metrics = urllib.request.urlopen(r.url + "/metrics").read().decode()
        assert f"kiln:router_retries_total {float(len(canary))}" in metrics
        assert 'kiln:router_time_to_first_token_seconds_bucket{arm="stable"' in metrics


def test_canary_killed_mid_stream_costs_the_client_nothing():
    with FakeServer(fake(ttft_ms=10, tpot_ms=30)) as s, FakeServer(fake(ttft_ms=10, tpot_ms=30)) as c, \
            router(s, c, affinity="random", weight=50) as r:
        with SteadyLoad(r.url, concurrency=8, max_tokens=20) as load:
            time.sleep(1.5)
            os.kill(c.pid, signal.SIGKILL)  # streams on the canary break mid-way
            time.sleep(1.5)
        assert load.stats.failures == [] and load.stats.ok > 20
        obs = r.observations()["observations"]
        broken = [o for o in obs if o["arm"] == "canary" and o["error"] is not None]
        assert broken and all(o["retried"] for o in broken)


def test_api_key_guards_generation_and_admin_not_health(pair):
    s, c = pair
    with RouterProcess(RouterConfig(port=0, stable_url=s.url, canary_url=c.url), api_key="sekret") as r:
        assert post_all(r.url, [body(stream=False)])[0][0] == 401
        assert post_all(r.url, [body(stream=False)], key="sekret")[0][0] == 200
        lower = urllib.request.Request(r.url + "/admin/state", headers={"Authorization": "bearer sekret"})
        assert urllib.request.urlopen(lower).status == 200  # the scheme is case-insensitive (RFC 7235)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(r.url + "/admin/state"))
        assert e.value.code == 401
        assert r.state()["weight"] == 0  # RouterProcess sends the key
        assert urllib.request.urlopen(r.url + "/health").status == 200


def test_client_errors_pass_through_and_do_not_count_against_an_arm(pair):
    s, c = pair
    with router(s, c, affinity="random", weight=50) as r:
        results = post_all(r.url, [body(i, max_tokens=-1) for i in range(10)])
        assert {st for st, _ in results} == {400}
        obs = r.observations()["observations"]
        assert all(o["status"] == 400 and not o["retried"] for o in obs)


def test_mirrored_greedy_requests_are_compared(pair):
    s, c = pair
    with router(s, c, affinity="random", weight=50, mirror_fraction=1.0) as r:
        post_all(r.url, [body(i, temperature=0) for i in range(20)] + [body(i, temperature=0.7) for i in range(5)])
        time.sleep(0.5)
        comparisons = r.observations()["comparisons"]
        assert len(comparisons) == 20  # sampled (temperature 0.7) requests are never mirrored
        assert all(x["match"] == 1 and x["prefix"] == 1.0 for x in comparisons)  # identical fakes
        # the noise floor: one deterministic stable agrees with itself on every prompt
        assert all(x["floor_match"] == 1 and x["floor_prefix"] == 1.0 for x in comparisons)
        assert {x["primary"] for x in comparisons} == {"stable", "canary"}


def test_stable_failures_reach_the_client_as_errors_not_hangs():
    with FakeServer(fake(error_rate=1.0)) as s, router(s, None) as r:
        (status, raw), (status_whole, _) = post_all(r.url, [body(), body(stream=False)])
        assert status == 500 and b"stable backend failed" in raw and status_whole == 500
        s.__exit__(None, None, None)  # stable gone: connection refused
        status, raw = post_all(r.url, [body()])[0]
        assert status == 502 and b"stable backend failed" in raw
        assert all(o["arm"] == "stable" and not o["retried"] for o in r.observations()["observations"])


def test_a_mirrored_pair_is_scored_as_the_offline_served_check_scores_it():
    from kiln.evaluate.quality.served import served_scores

    assert served_scores([5, 6, 7, 8], [5, 6, 0, 8], 4) == (0.5, 0.0)  # offline: token ids, of max_new_tokens
    assert served_scores("a cat sat", "a cat sat") == (1.0, 1.0)  # live: the answers' text
    assert served_scores("a cat sat", "a cow sat") == (3 / 9, 0.0)
    assert served_scores("a cat", "a cat sat") == (5 / 9, 0.0)  # one answer stopped early
    assert served_scores("", "") == (1.0, 1.0)
