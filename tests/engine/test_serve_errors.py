"""Every client mistake gets an OpenAI-style JSON 4xx from `kiln serve` (issue 16's table), one
bad request never fails the requests decoding beside it, and fuzzed bodies never get a 5xx."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import urllib.parse

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.engine.base import GenerationRequest
from kiln.engine.serve.server_thread import ServerThread

KEY = "test-key"
C, CHAT = "/v1/completions", "/v1/chat/completions"
DEEP = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.fixture(scope="module")
def server(served_engine):
    with ServerThread(served_engine, api_key=KEY, model_name="tiny") as srv:
        yield srv


def _request(url: str, path: str, body: dict | bytes | None = None, method: str = "POST",
             auth: str = f"Bearer {KEY}") -> tuple[int, str, bytes]:
    """Status, content type and body; any bytes go out as they are."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers={"Authorization": auth, "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


# (id, path, body, status, what the message or param must name)
TABLE = [
    ("body not UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("deeply nested JSON", C, DEEP, 400, "nests"),
    ("chat content 5", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat message without content", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat messages []", CHAT, {"messages": []}, 400, "messages"),
    ("token id 10^9", C, {"prompt": [1_000_000_000], "max_tokens": 2}, 400, "prompt"),
    ("token id -3", C, {"prompt": [5, -3], "max_tokens": 2}, 400, "prompt"),
    ("stop 5", C, {"prompt": "Hello", "stop": 5}, 400, "stop"),
    ("stop [1, 2]", C, {"prompt": "Hello", "stop": [1, 2]}, 400, "stop"),
    ("stream_options 'x'", C, {"prompt": "Hello", "stream": True, "stream_options": "x"}, 400, "stream_options"),
    ("seed 2**70", C, {"prompt": "Hello", "seed": 2**70}, 400, "seed"),
    ("model no-such-model", C, {"model": "no-such-model", "prompt": "Hello"}, 404, "model"),
    ("model 5", C, {"model": 5, "prompt": "Hello"}, 404, "model"),
    ("temperature NaN", C, b'{"prompt": "Hello", "temperature": NaN}', 400, "NaN"),
    ("temperature Infinity", C, b'{"prompt": "Hello", "temperature": Infinity}', 400, "Infinity"),
    ("temperature 1e400", C, b'{"prompt": "Hello", "temperature": 1e400}', 400, "temperature"),
    ("top_p 7", C, {"prompt": "Hello", "top_p": 7}, 400, "top_p"),
    ("role wizard", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("presence_penalty 1", C, {"prompt": "Hello", "presence_penalty": 1}, 400, "presence_penalty"),
    ("frequency_penalty 0.5", CHAT, {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5},
     400, "frequency_penalty"),
    ("logit_bias", C, {"prompt": "Hello", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("best_of 2", C, {"prompt": "Hello", "best_of": 2}, 400, "best_of"),
    ("max_tokens 10^12", C, {"prompt": "Hello", "max_tokens": 10**12}, 400, "1000000000000"),
    ("prompt + max_tokens beyond the context", C, {"prompt": [5] * 1000, "max_tokens": 100}, 400, "1100"),
    ("too-long prompt, streamed", C, {"prompt": [5] * 1025, "max_tokens": 2, "stream": True}, 400, "1025"),
]


@pytest.mark.parametrize(("path", "body", "status", "names"), [r[1:] for r in TABLE], ids=[r[0] for r in TABLE])
def test_every_client_mistake_is_a_json_4xx(server, path, body, status, names):
    got, kind, raw = _request(server.url, path, body)
    assert got == status, raw[:300]
    assert kind.startswith("application/json")
    error = json.loads(raw)["error"]
    assert names in error["message"] or names == error["param"], error
    if status == 404:
        assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nothing", 404), ("GET", C, 405),
                                                        ("POST", C, 413)])
def test_routing_errors_are_json(server, method, path, status):
    body = b"{" + b" " * (64 * 2**20 + 1) + b"}" if status == 413 else None
    got, kind, raw = _request(server.url, path, body, method=method)
    assert got == status and kind.startswith("application/json")
    assert json.loads(raw)["error"]["code"] == status


def test_bearer_scheme_is_case_insensitive(server):
    for auth in (f"bearer {KEY}", f"BEARER  {KEY}"):
        assert _request(server.url, "/v1/models", method="GET", auth=auth)[0] == 200
    assert _request(server.url, "/v1/models", method="GET", auth=f"Basic {KEY}")[0] == 401


def test_top_p_is_nucleus_sampling(server, torch_engine):
    """A top_p below the most likely token's probability keeps that token alone: at temperature 1
    that is the greedy text (the tiny random model's top token has ~1e-4, so 1e-4 would keep two)."""
    ids = torch_engine.tokenizer("The quick brown fox").input_ids
    greedy = [e.token_id for e in torch_engine.generate([GenerationRequest(ids, 12, ignore_eos=True)])]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "seed": 3}
    for top_p in (1e-9, 1e-300):  # 1e-300 is 0 in float32: the top token must still stay
        status, _, raw = _request(server.url, C, {**body, "top_p": top_p})
        assert status == 200, raw[:300]
        assert json.loads(raw)["choices"][0]["text"] == torch_engine.tokenizer.decode(greedy, skip_special_tokens=True)
    sampled = json.loads(_request(server.url, C, body)[2])["choices"][0]["text"]
    assert sampled != json.loads(raw)["choices"][0]["text"]  # without top_p the random model's text is random


def test_openai_sdk_gets_a_4xx_not_retried_500s(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=2)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="Hello", top_p=7)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="Hello")


# ----- one bad request never fails the others ---------------------------------------------------

# Their greedy top-2 logit gaps stay above 0.005 over 100 tokens on the tiny model, far above
# the float noise between decoding in a batch, alone, or resumed after a failed step.
GOOD_PROMPTS = ("In the beginning", "A long time ago", "My dear sir")
POISON = [{"prompt": [1_000_000_000], "max_tokens": 2}, {"prompt": "Hello", "temperature": 1e-40, "max_tokens": 2},
          {"prompt": [5, -3], "max_tokens": 2}, {"prompt": "Hello", "top_p": 7},
          {"prompt": "Hello", "seed": 2**70, "temperature": 1}]


@pytest.mark.parametrize("poison", POISON, ids=lambda p: json.dumps(p)[:40])
def test_a_poison_request_beside_three_decoding_ones(server, torch_engine, poison):
    prompts = [torch_engine.tokenizer(p).input_ids for p in GOOD_PROMPTS]
    expected = [torch_engine.tokenizer.decode([e.token_id for e in torch_engine.generate(
        [GenerationRequest(p, 60, ignore_eos=True)])], skip_special_tokens=True) for p in prompts]
    results: list = [None] * 3

    def good(i: int) -> None:
        results[i] = _request(server.url, C, {"prompt": prompts[i], "max_tokens": 60, "temperature": 0,
                                              "ignore_eos": True})

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    status, _, raw = _request(server.url, C, poison)
    for t in threads:
        t.join(120)
    assert status < 500, raw[:300]  # refused (400), or for temperature 1e-40 served greedily
    for (code, _, body), text in zip(results, expected, strict=True):
        assert code == 200, body[:300]
        assert json.loads(body)["choices"][0]["text"] == text


@pytest.mark.parametrize("poison", [GenerationRequest([1_000_000_000], 2), GenerationRequest([5, 6], 2, temperature=1e-40)],
                         ids=["token id 10^9", "temperature 1e-40"])
def test_the_scheduler_fails_only_the_request_that_breaks_the_step(tiny_model_dir, torch_engine, poison):
    """Past the edge's validation (a backend's own limits, a bug): the step fails, and only the
    request that fails again alone gets the error; the others finish with their full output."""
    import asyncio

    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig
    from kiln.engine.serve.scheduler import Metrics, Scheduler

    engine = TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))  # this test's scheduler owns it

    prompts = [torch_engine.tokenizer(p).input_ids for p in GOOD_PROMPTS]
    expected = [[e.token_id for e in torch_engine.generate([GenerationRequest(p, 100, ignore_eos=True)])]
                for p in prompts]

    async def run() -> tuple[list[list[int]], Exception | None]:
        scheduler = Scheduler(engine, asyncio.get_running_loop(), Metrics())
        scheduler.start()
        try:
            goods = [scheduler.submit(GenerationRequest(p, 100, ignore_eos=True)) for p in prompts]
            while not all(t.count >= 3 for t in goods):  # all three decoding together
                await asyncio.sleep(0.01)
            bad = scheduler.submit(poison)
            outputs = []
            for t in goods:
                ids = []
                while (ev := await t.events.get()) is not None:
                    assert not isinstance(ev, Exception), ev
                    ids.append(ev.token_id)
                outputs.append(ids)
            return outputs, await bad.events.get()
        finally:
            scheduler.stop()

    try:
        outputs, error = asyncio.run(run())
    finally:
        engine.close()
    assert outputs == expected
    assert isinstance(error, Exception)


# ----- fuzzed bodies ------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
_values = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids,
                                                                                        max_size=3), max_leaves=8)
_ids = st.lists(st.integers(-5, 60_000), max_size=4)  # the tiny model's vocabulary is 49152
_near = {  # values near the valid ones, where the edge cases are; any field may also get any value
    "model": st.sampled_from(["tiny", "other"]),
    "prompt": st.text(max_size=12) | _ids | st.lists(_ids, max_size=2) | st.lists(st.text(max_size=5), max_size=2),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]),
         "content": st.text(max_size=8) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                          "text": st.text(max_size=5)}), max_size=2)}),
        max_size=3),
    "max_tokens": st.integers(-2, 4), "max_completion_tokens": st.integers(-2, 4),
    "temperature": st.floats(-1, 3) | st.just(1e-40), "top_p": st.floats(-0.5, 1.5), "seed": st.integers(-5, 2**64),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "logprobs": st.integers(-1, 21),
    "echo": st.booleans(), "n": st.integers(0, 2), "ignore_eos": st.booleans(),
    "presence_penalty": st.sampled_from([0, 0.0, 1]), "logit_bias": st.sampled_from([{}, {"5": 1}]),
    "stop_token_ids": _ids, "return_tokens_as_token_ids": st.booleans(), "top_logprobs": st.integers(0, 2),
}
_overrides = st.lists(st.sampled_from(sorted(_near)), max_size=3, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({n: _near[n] | _values for n in names}))
_BASES = {C: {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
          CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from([C, CHAT]), overrides=_overrides)
def test_fuzzed_bodies_never_get_a_5xx(server, path, overrides):
    """A valid body with up to three fields changed to near-valid or arbitrary values."""
    body = {**_BASES[path], **overrides}
    for name in ("max_tokens", "max_completion_tokens"):  # keep the valid ones quick
        if isinstance(body.get(name), int) and 4 < body[name] < 10**6:
            body[name] = 4
    status, kind, raw = _request(server.url, path, json.dumps(body, allow_nan=True).encode())
    assert status < 500, raw[:500]
    assert kind.startswith(("application/json", "text/event-stream"))
    if kind.startswith("text/event-stream"):  # a stream that started must end cleanly, no error event
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw, raw[-500:]


# ----- the command line ---------------------------------------------------------------------------

def _kiln(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    import os

    no_key = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}  # set to "", it is refused as blank
    r = subprocess.run([sys.executable, "-m", "kiln.pipeline", *args], capture_output=True, text=True,
                       timeout=timeout, env={**no_key, **(env or {})})
    r.stderr = " ".join(r.stderr.split())  # rich wraps lines at the terminal width
    return r


@pytest.mark.parametrize("command", [["serve", "ENGINE"], ["route", "--stable", "http://127.0.0.1:9"]])
def test_non_loopback_host_needs_a_key_or_the_explicit_flag(command, tmp_path):
    args = [a.replace("ENGINE", str(tmp_path)) for a in command]
    r = _kiln(*args, "--host", "0.0.0.0")
    assert r.returncode == 2 and "--insecure-no-api-key" in r.stderr and "Traceback" not in r.stderr


def test_a_broken_engine_folder_fails_at_start_with_the_fix(tiny_model_dir, tmp_path):
    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path / "cache")
    broken = tmp_path / "broken"
    broken.mkdir()
    manifest = json.loads((engine_dir / "kiln-engine.json").read_text())
    manifest["build"]["checkpoint"] = str(tmp_path / "gone")
    (broken / "kiln-engine.json").write_text(json.dumps(manifest))
    r = _kiln("serve", str(broken), "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "kiln run RECIPE --fresh engine" in r.stderr and "kiln engine build" not in r.stderr
    assert "Traceback" not in r.stderr
    (broken / "kiln-engine.json").write_text("{not json")
    r = _kiln("serve", str(broken))
    assert r.returncode == 2 and "not valid JSON" in r.stderr and "kiln run" in r.stderr


def test_a_port_in_use_is_exit_2_not_a_traceback(tiny_model_dir, tmp_path):
    import socket

    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        served = _kiln("serve", str(engine_dir), "--port", port)
        routed = _kiln("route", "--stable", "http://127.0.0.1:9", "--port", port)
    for r in (served, routed):
        assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr, r.stderr
