"""The OpenAI-compatible server over the torch engine, driven by the official `openai` client."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from kiln.engine.base import GenerationRequest
from kiln.engine.serve.server_thread import ServerThread

KEY = "test-key"


@pytest.fixture(scope="module")
def server(served_engine):
    with ServerThread(served_engine, api_key=KEY, model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _get(url: str, key: str | None = KEY) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _greedy_text(engine, prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    ids = [e.token_id for e in engine.generate([GenerationRequest(prompt_ids, n, ignore_eos=True)])]
    return ids, engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_models_list(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_completion_matches_engine_greedy(client, torch_engine):
    prompt = "It is a truth universally acknowledged"
    _, text = _greedy_text(torch_engine, torch_engine.tokenizer(prompt).input_ids, 10)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10


def test_streaming_completion_and_usage(client, torch_engine):
    ids = torch_engine.tokenizer("The quick brown fox").input_ids
    _, text = _greedy_text(torch_engine, ids, 12)
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == len(ids)


def test_several_prompts_in_one_request(client, torch_engine):
    prompts = [[*torch_engine.tokenizer("Hello there").input_ids], [*torch_engine.tokenizer("Once upon").input_ids]]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    by_index = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == [_greedy_text(torch_engine, p, 5)[1] for p in prompts]


def test_stop_string_truncates_and_finishes(client, torch_engine):
    ids = torch_engine.tokenizer("The quick brown fox").input_ids
    _, text = _greedy_text(torch_engine, ids, 12)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_streaming(client, torch_engine):
    messages = [{"role": "user", "content": "Say hello"}]
    tok = torch_engine.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    _, text = _greedy_text(torch_engine, ids, 8)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == text


def test_echo_logprobs_on_token_ids_equal_engine_score_without_bos(client, torch_engine):
    tok = torch_engine.tokenizer
    ctx = tok("The capital of France is").input_ids
    cont = tok(" Paris, and it is lovely", add_special_tokens=False).input_ids
    expected = torch_engine.score([(ctx, cont)])[0]
    # What lm-eval's local-completions sends for a log-likelihood request (max_tokens=1 in 0.4.13).
    r = client.completions.create(model="tiny", prompt=[ctx + cont], max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ctx) + len(cont) + 1  # prompt exactly as sent, + 1 generated: no BOS added
    assert lp.token_logprobs[0] is None
    got = lp.token_logprobs[len(ctx) : len(ctx) + len(cont)]
    assert got == pytest.approx(list(expected.token_logprobs), abs=1e-4)
    greedy = all(t >= max(top.values()) for t, top in zip(got, lp.top_logprobs[len(ctx) : -1], strict=True))
    assert greedy == expected.is_greedy
    # max_tokens=0 scores the prompt alone.
    r0 = client.completions.create(model="tiny", prompt=[ctx + cont], max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].logprobs.token_logprobs[len(ctx) :] == pytest.approx(got, abs=1e-4)


def test_api_key_is_enforced(server):
    assert _get(f"{server.url}/v1/models", key=None)[0] == 401
    assert _get(f"{server.url}/v1/models", key="wrong")[0] == 401
    assert _get(f"{server.url}/v1/models")[0] == 200
    assert _get(f"{server.url}/health", key=None)[0] == 200  # probes need no key


def test_metrics_expose_latency_histograms(client, server):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    status, text = _get(f"{server.url}/metrics")
    assert status == 200
    for name in ("kiln:time_to_first_token_seconds_bucket", "kiln:time_per_output_token_seconds_bucket",
                 "kiln:e2e_request_latency_seconds_bucket", "kiln:num_requests_running", "kiln:num_requests_waiting",
                 "kiln:prompt_tokens_total", "kiln:generation_tokens_total", 'kiln:requests_total{outcome="success"}'):
        assert name in text
    count = next(line for line in text.splitlines() if line.startswith("kiln:time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_bad_request_is_a_400_naming_the_field(server):
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": -1}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body,
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "max_tokens" in json.loads(e.value.read())["error"]["message"]


def test_client_disconnect_cancels_the_sequence(server, client, served_engine):
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # drop the connection mid-generation
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = _get(f"{server.url}/metrics")[1]
        in_flight = next(line for line in text.splitlines() if line.startswith("kiln:num_requests_running "))
        if float(in_flight.split()[-1]) == 0 and not served_engine.has_work():
            break
        time.sleep(0.05)
    else:
        pytest.fail("sequence still running after the client disconnected")


def test_health_is_503_until_loaded_and_warmed_up(torch_engine):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return torch_engine

    srv = ServerThread(slow_load).start(wait_ready=None)
    try:
        assert _get(f"{srv.url}/health", key=None)[0] == 503
        assert _get(f"{srv.url}/v1/models", key=None)[0] == 503
        release.set()
        deadline = time.monotonic() + 60
        while _get(f"{srv.url}/health", key=None)[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert srv.status == "ready"
    finally:
        srv.stop()


def test_too_long_prompt_is_a_400_streamed_or_not(server, client, torch_engine):
    too_long = [5] * (torch_engine.max_positions + 1)
    with pytest.raises(openai.BadRequestError, match=f"context is {torch_engine.max_positions} tokens"):
        client.completions.create(model="tiny", prompt=too_long, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"has {len(too_long)} tokens"):  # before the stream starts
        client.completions.create(model="tiny", prompt=too_long, max_tokens=2, stream=True)


def test_streamed_logprobs_carry_token_ids(client, torch_engine):
    ids = torch_engine.tokenizer("Hello there").input_ids
    expected = [e.token_id for e in torch_engine.generate([GenerationRequest(ids, 4, ignore_eos=True)])]
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, stream=True,
                                            logprobs=0, extra_body={"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True}))
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert tokens == [f"token_id:{t}" for t in expected]
    assert all(lp < 0 for c in chunks for lp in c.choices[0].logprobs.token_logprobs)


@pytest.mark.slow
def test_serve_as_a_subprocess(tiny_model_dir, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "KILN_API_KEY": KEY}
    argv = [sys.executable, "-m", "kiln.engine.serve.server", str(engine_dir), "--port", str(port)]
    proc = subprocess.Popen(argv, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                if _get(f"http://127.0.0.1:{port}/health", key=None)[0] == 200:
                    break
            except urllib.error.URLError:  # not listening yet
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
        served = client.models.list().data[0].id
        assert client.completions.create(model=served, prompt="Hello", max_tokens=3).usage.completion_tokens <= 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
