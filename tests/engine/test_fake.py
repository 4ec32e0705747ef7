"""The fake engine: OpenAI-compatible shapes, timing, queueing, errors, auth, health, metrics."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kiln.engine.serve.fake import FakeEngineConfig, FakeServer


def _post(url: str, body: dict, key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _events(raw: bytes) -> list[dict | str]:
    out: list[dict | str] = []
    for ev in raw.decode().split("\n\n"):
        if ev.startswith("data: "):
            data = ev[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def server():
    with FakeServer(FakeEngineConfig(ttft_ms=30, tpot_ms=5, model="fake-m")) as s:
        yield s


def test_streaming_completion_shape(server):
    body = {
        "model": "fake-m",
        "prompt": [1, 2, 3, 4],
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    status, raw = _post(server.url + "/v1/completions", body)
    events = _events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    tokens, usage = events[:-2], events[-2]
    assert len(tokens) == 7 and all(e["object"] == "text_completion" and e["choices"][0]["text"] for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 6 + ["length"]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    assert len({e["id"] for e in events[:-1]}) == 1


def test_prompt_forms_and_batch(server):
    for prompt, n in (("three word prompt", 3), ([[1, 2], [3, 4, 5]], 5), (["a b", "c"], 3)):
        status, raw = _post(server.url + "/v1/completions", {"model": "fake-m", "prompt": prompt, "max_tokens": 2})
        out = json.loads(raw)
        assert status == 200 and out["usage"]["prompt_tokens"] == n
    assert len(out["choices"]) == 2 and out["choices"][1]["index"] == 1


def test_chat_streaming_and_whole(server):
    body = {"model": "fake-m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3, "stream": True}
    events = _events(_post(server.url + "/v1/chat/completions", body)[1])
    assert events[-1] == "[DONE]" and len(events) == 4  # no usage chunk unless asked for
    assert all(e["object"] == "chat.completion.chunk" and e["choices"][0]["delta"]["content"] for e in events[:-1])
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    whole = json.loads(_post(server.url + "/v1/chat/completions", {**body, "stream": False})[1])
    assert whole["object"] == "chat.completion" and whole["usage"]["completion_tokens"] == 3
    assert whole["choices"][0]["message"]["content"] == " tok" * 3


def test_tokens_are_scheduled_at_absolute_times(server):
    # 40 tokens at 5 ms: a sleep-after-write loop drifts by each wake-up's lateness, absolute
    # scheduling ends at 30 + 39 * 5 = 225 ms plus one wake-up's lateness at most.
    t = time.perf_counter()
    status, _ = _post(server.url + "/v1/completions", {"model": "fake-m", "prompt": "x", "max_tokens": 40})
    elapsed_ms = (time.perf_counter() - t) * 1000
    assert status == 200 and 225 <= elapsed_ms < 260


def test_models_health_metrics(server):
    models = json.loads(urllib.request.urlopen(server.url + "/v1/models").read())
    assert models["data"][0]["id"] == "fake-m"
    assert urllib.request.urlopen(server.url + "/health").status == 200
    _post(server.url + "/v1/completions", {"model": "fake-m", "prompt": "x y", "max_tokens": 3})
    text = urllib.request.urlopen(server.url + "/metrics").read().decode()
    for name in (
        "kiln:time_to_first_token_seconds_bucket",
        "kiln:time_per_output_token_seconds_count",
        "kiln:e2e_request_latency_seconds_sum",
        "kiln:num_requests_running",
        "kiln:num_requests_waiting",
        "kiln:prompt_tokens_total",
        "kiln:generation_tokens_total",
        'kiln:requests_total{outcome="success"}',
    ):
        assert name in text


def test_bad_requests_are_400(server):
    for body in ({"model": "m"}, {"model": "m", "prompt": "x", "max_tokens": 0}, {"model": "m", "prompt": [1.5]}):
        status, raw = _post(server.url + "/v1/completions", body)
        assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_api_key_and_startup():
    with FakeServer(FakeEngineConfig(startup_s=1.0), api_key="sekret") as s:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.url + "/health")
        assert e.value.code == 503  # still "loading"
        assert _post(s.url + "/v1/completions", {"prompt": "x"})[0] == 401
        assert _post(s.url + "/v1/completions", {"prompt": "x"}, key="wrong")[0] == 401
        assert _post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}, key="sekret")[0] == 200
        lower = urllib.request.Request(s.url + "/v1/models", headers={"Authorization": "bearer sekret"})
        assert urllib.request.urlopen(lower).status == 200  # the scheme is case-insensitive (RFC 7235)
        time.sleep(1.0)
        assert urllib.request.urlopen(s.url + "/health").status == 200


def test_capacity_queues_requests():
    # One slot, 100 ms per request: three at once finish at ~100, ~200, ~300 ms.
    with FakeServer(FakeEngineConfig(ttft_ms=100, tpot_ms=0, capacity=1)) as s:

        def one(_: int) -> float:
            t = time.perf_counter()
            _post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            return time.perf_counter() - t

        with ThreadPoolExecutor(3) as pool:
            times = sorted(pool.map(one, range(3)))
        assert times[0] == pytest.approx(0.1, abs=0.05)
        assert times[2] == pytest.approx(0.3, abs=0.08)
        assert len(s.arrivals()) == 3


def test_error_rate_is_seeded():
    def pattern() -> list[int]:
        with FakeServer(FakeEngineConfig(ttft_ms=0, tpot_ms=0, error_rate=0.5, seed=3)) as s:
            return [_post(s.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] for _ in range(20)]

    first = pattern()
    assert set(first) == {200, 500} and first == pattern()


def test_openai_client_streams_unchanged(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    stream = client.completions.create(
        model="fake-m", prompt="hello", max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 5
    assert chunks[-1].usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="fake-m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat) == " tok" * 4
    assert [m.id for m in client.models.list()] == ["fake-m"]
