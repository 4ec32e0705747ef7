"""The remote backend against kiln's own server: same tokens and scores as the local engine."""

from __future__ import annotations

import pydantic
import pytest

from kiln.engine.base import GenerationRequest
from kiln.engine.cache import build_engine
from kiln.engine.loader import load_engine
from kiln.engine.remote import RemoteEngine, RemoteEngineConfig
from kiln.engine.serve.server_thread import ServerThread
from kiln.core.errors import BadInput

KEY = "remote-key"


@pytest.fixture(scope="module")
def server(served_engine):
    with ServerThread(served_engine, api_key=KEY, model_name="tiny") as srv:
        yield srv


@pytest.fixture()
def remote(server, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KILN_TEST_REMOTE_KEY", KEY)
    engine = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny", api_key_env="KILN_TEST_REMOTE_KEY"),
                          tiny_model_dir)
    yield engine
    engine.close()


def _tokens(engine, requests) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in engine.generate(requests):
        out.setdefault(ev.seq_id, []).append(ev.token_id)
    return out


def test_generation_parity_with_the_local_engine(remote, torch_engine):
    tok = torch_engine.tokenizer
    requests = [GenerationRequest(tok(t).input_ids, 8, ignore_eos=True) for t in ("Hello there", "Once upon a time")]
    local = [[e.token_id for e in torch_engine.generate([r])] for r in requests]
    got = _tokens(remote, requests)
    assert sorted(got.values()) == sorted(local)
    assert not remote.has_work()


def test_score_parity_with_the_local_engine(remote, torch_engine):
    tok = torch_engine.tokenizer
    pairs = [(tok("The capital of France is").input_ids, tok(" Paris", add_special_tokens=False).input_ids),
             (tok("Hello").input_ids, tok(" world again", add_special_tokens=False).input_ids)]
    for got, want in zip(remote.score(pairs), torch_engine.score(pairs), strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-3)
        assert got.is_greedy == want.is_greedy


def test_cancel_stops_the_stream(remote, torch_engine):
    seq = remote.add(GenerationRequest(torch_engine.tokenizer("Hello").input_ids, 400, ignore_eos=True))
    while not remote.step():
        pass
    remote.cancel(seq)
    assert not remote.has_work() and remote.step() == []


def test_full_distributions_are_refused(remote):
    with pytest.raises(BadInput, match="local engine"):
        remote.next_token_logprobs([[1, 2, 3]])


def test_missing_key_variable_is_bad_input(server, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("KILN_TEST_UNSET_KEY", raising=False)
    with pytest.raises(BadInput, match="KILN_TEST_UNSET_KEY"):
        RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny", api_key_env="KILN_TEST_UNSET_KEY"),
                     tiny_model_dir)


def test_wrong_key_is_bad_input(server, tiny_model_dir, torch_engine):
    engine = RemoteEngine(RemoteEngineConfig(url=server.url, model="tiny"), tiny_model_dir, api_key="nope")
    try:
        with pytest.raises(BadInput, match="401"):
            engine.score([([1, 2], [3])])
    finally:
        engine.close()


def test_config_rejects_a_key_in_place_of_a_variable_name():
    with pytest.raises(pydantic.ValidationError):
        RemoteEngineConfig(url="http://127.0.0.1:1", model="m", api_key_env="sk-live-1234")
    with pytest.raises(pydantic.ValidationError):
        RemoteEngineConfig(url="127.0.0.1:8000", model="m")
    assert RemoteEngineConfig(url="http://h:1/", model="m").url == "http://h:1/v1"


def test_text_only_servers_still_stream_tokens(server, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KILN_TEST_REMOTE_KEY", KEY)
    config = RemoteEngineConfig(url=server.url, model="tiny", api_key_env="KILN_TEST_REMOTE_KEY",
                                stream_token_ids=False)
    engine = RemoteEngine(config, tiny_model_dir)
    try:
        events = list(engine.generate([GenerationRequest(engine.tokenizer("Hello").input_ids, 6, ignore_eos=True)]))
        assert events and events[-1].finish_reason == "length"
    finally:
        engine.close()


def test_built_remote_engine_loads_anywhere(server, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TEST_REMOTE_KEY", KEY)
    config = RemoteEngineConfig(url=server.url, model="tiny", api_key_env="KILN_TEST_REMOTE_KEY")
    engine_dir = build_engine(config, tiny_model_dir, "checkpoint-sha", tmp_path)
    import kiln.engine.loader as loader

    monkeypatch.setattr(loader, "hardware_fingerprint", lambda: {"cpu": "elsewhere"})  # not checked
    engine = load_engine(engine_dir)
    try:
        assert engine.manifest["hardware"] is None
        assert engine.score([([1, 2], [3])])[0].logprob < 0
    finally:
        engine.close()


def test_close_leaves_no_stream_pending(tiny_model_dir):
    """A server that sends a sequence's last token and holds the stream open before `[DONE]` (a slow proxy, a
    busy server): the sequence is finished, and closing the engine still ends its stream rather than leaving
    it pending in a stopped loop, which asyncio reported in the middle of a run's console."""
    import asyncio
    import json
    import threading

    from aiohttp import web

    release = asyncio.Event()

    async def completions(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"text": "", "token_ids": [5], "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await release.wait()
        return resp

    loop, ready = asyncio.new_event_loop(), threading.Event()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)

    def serve() -> None:
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        ready.set()
        loop.run_forever()

    threading.Thread(target=serve, daemon=True).start()
    assert ready.wait(10)
    url = "http://127.0.0.1:%d/v1" % runner.addresses[0][1]
    engine = RemoteEngine(RemoteEngineConfig(url=url, model="slow"), tiny_model_dir)
    try:
        events = list(engine.generate([GenerationRequest([1, 2, 3], 1, ignore_eos=True)]))
        assert [e.finish_reason for e in events] == ["length"]
    finally:
        engine.close()
        loop.call_soon_threadsafe(release.set)
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert [t for t in asyncio.all_tasks(engine._loop) if not t.done()] == []
