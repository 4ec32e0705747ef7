"""`kiln serve` in production: full queue -> fast 429, per-key rate limits, one JSON log line per
request, cold-start figures, and SIGTERM drain of a real `kiln serve` process (tiny model)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kiln.engine.serve.admission import AdmissionConfig
from kiln.engine.serve.server_thread import ServerThread

KEY = "test-key"


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and whole body of a POST (errors included)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _open_stream(url: str, body: dict, key: str | None = KEY):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=60)


def _events(stream) -> list[str]:
    """The remaining SSE data payloads of an open stream."""
    return [line[len(b"data: "):].decode().strip() for line in stream if line.startswith(b"data: ")]


def _metric(url: str, name: str, key: str | None = KEY) -> float:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        line = next(x for x in r.read().decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def _wait_for(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_full_queue_answers_429_with_retry_after_while_the_engine_is_busy(served_engine):
    config = AdmissionConfig(max_concurrency=1, max_queue=1, retry_after_s=2)
    long = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    with ServerThread(served_engine, api_key=KEY, admission=config) as srv:
        running = _open_stream(srv.url, long)
        first = running.readline()  # its first token is out: it holds the only slot
        queued: list = []
        waiter = threading.Thread(target=lambda: queued.append(_post(srv.url + "/v1/completions",
                                                                     {**long, "max_tokens": 3})))
        waiter.start()
        _wait_for(lambda: _metric(srv.url, "kiln:admission_queue_depth") == 1)
        start = time.perf_counter()
        status, headers, body = _post(srv.url + "/v1/completions", long)
        refused_in = time.perf_counter() - start
        rest = _events(running)
        waiter.join(60)
        rejected = _metric(srv.url, 'kiln:admission_rejected{reason="queue_full"}')
    assert status == 429 and headers["Retry-After"] == "2" and json.loads(body)["error"]["type"] == "overloaded"
    assert refused_in < 1.0  # at once, not after the running stream's ~100 tokens
    assert first.startswith(b"data: ") and rest[-1] == "[DONE]" and len(rest) == 100  # 99 more tokens + [DONE]
    assert queued[0][0] == 200 and json.loads(queued[0][2])["usage"]["completion_tokens"] == 3
    assert rejected == 1


def test_rate_limit_is_per_api_key(served_engine):
    config = AdmissionConfig(rate_limit_rps=0.1, rate_limit_burst=2)
    one = {"prompt": "Hello", "max_tokens": 1}
    with ServerThread(served_engine, api_key="alice-key,bob-key", admission=config) as srv:
        url = srv.url + "/v1/completions"
        assert _post(url, one, key="mallory-key")[0] == 401  # a wrong key is refused before any bucket
        alice = [_post(url, one, key="alice-key") for _ in range(3)]
        bob = [_post(url, one, key="bob-key") for _ in range(2)]
    assert [a[0] for a in alice] == [200, 200, 429]
    assert alice[2][1]["Retry-After"] == "10"  # one token at 0.1/s
    assert [b[0] for b in bob] == [200, 200]  # the other tenant has its own bucket


def test_one_json_log_line_per_request_with_timings_and_tokens(served_engine, torch_engine, caplog):
    ids = torch_engine.tokenizer("It is a truth universally acknowledged").input_ids
    two = [ids, torch_engine.tokenizer("Once upon a time").input_ids]
    with caplog.at_level(logging.INFO, logger="kiln.requests"), ServerThread(served_engine, api_key=KEY) as srv:
        with _open_stream(srv.url, {"prompt": ids, "max_tokens": 8, "ignore_eos": True}) as s:
            assert _events(s)[-1] == "[DONE]"
        assert _post(srv.url + "/v1/completions", {"prompt": two, "max_tokens": 5, "ignore_eos": True})[0] == 200
        assert _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": -1})[0] == 400
        _wait_for(lambda: sum(r.name == "kiln.requests" for r in caplog.records) >= 3)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "kiln.requests"]
    assert len(lines) == 3
    streamed, batched, bad = lines
    assert streamed["status"] == 200 and streamed["tokens_in"] == len(ids) and streamed["tokens_out"] == 8
    assert 0 <= streamed["queue_ms"] <= streamed["ttft_ms"] <= streamed["e2e_ms"]
    assert streamed["tpot_ms"] > 0 and streamed["ttft_ms"] + 7 * streamed["tpot_ms"] <= streamed["e2e_ms"] + 1
    assert batched["tokens_in"] == sum(map(len, two)) and batched["tokens_out"] == 10
    assert batched["ttft_ms"] > 0 and batched["tpot_ms"] > 0
    assert bad["status"] == 400 and bad["tokens_out"] is None  # refused while parsing: nothing generated
    assert KEY not in json.dumps(lines)  # tenants are hashes of the key


def test_cold_start_is_split_into_boot_load_and_warmup(tiny_model_dir):
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    def slow_load():
        time.sleep(0.3)
        return TorchEngine(tiny_model_dir, TorchEngineConfig(threads=1))

    with ServerThread(slow_load) as srv:
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            health = json.loads(r.read())
        load_gauge = _metric(srv.url, 'kiln:cold_start_seconds{phase="load"}', key=None)
    cold = health["cold_start"]
    assert health["status"] == "ready" and set(cold) == {"boot_s", "load_s", "warmup_s", "total_s"}
    assert cold["load_s"] >= 0.3 and cold["warmup_s"] > 0 and cold["boot_s"] > 0
    assert cold["boot_s"] + cold["load_s"] + cold["warmup_s"] == pytest.approx(cold["total_s"], abs=0.01)
    assert load_gauge == cold["load_s"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> tuple[int, dict] | None:
    """/health's status and body; None when nothing listens."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except urllib.error.URLError:
        return None


def test_drain_finishes_the_stream_in_flight_and_refuses_new_work(served_engine):
    with ServerThread(served_engine, api_key=KEY) as srv:
        # 300 tokens: long enough that the stream is still running when drain begins (30 could all be
        # generated before the health check on a fast moment, seen in a fresh-clone CI run)
        stream = _open_stream(srv.url, {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True})
        first = stream.readline()  # in flight
        drained: list[bool] = []
        drainer = threading.Thread(target=lambda: drained.append(srv.drain()))
        drainer.start()
        _wait_for(lambda: _health(srv.url)[0] == 503)
        health = _health(srv.url)
        late = _post(srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        rest = _events(stream)
        drainer.join(60)
    assert health == (503, {"status": "draining", "running": 1})
    assert late[0] == 503 and late[1]["Retry-After"] == "1" and json.loads(late[2])["error"]["type"] == "unavailable"
    assert first.startswith(b"data: ") and rest[-1] == "[DONE]" and len(rest) == 300  # 299 more tokens + [DONE]
    assert drained == [True]


@pytest.mark.slow  # ~25 s here, most of it importing torch and transformers in the new process
@pytest.mark.timeout(180)
def test_kiln_serve_drains_on_sigterm_and_exits_0(tiny_model_dir, tmp_path):
    import os

    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    port, log = _free_port(), tmp_path / "requests.log"
    url = f"http://127.0.0.1:{port}"
    kiln = str(Path(sys.executable).with_name("kiln"))
    started = time.monotonic()
    proc = subprocess.Popen([kiln, "serve", str(engine_dir), "--port", str(port), "--request-log", str(log)],
                            env={**os.environ, "KILN_API_KEY": KEY}, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: proc.poll() is None and (_health(url) or (0,))[0] == 200, timeout=120)
        seen_ready = time.monotonic() - started
        cold = _health(url)[1]["cold_start"]
        stream = _open_stream(url, {"prompt": "Hello", "max_tokens": 40, "ignore_eos": True})
        first = stream.readline()  # in flight
        proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: (_health(url) or (503,))[0] == 503, timeout=10)
        late = _health(url)  # draining (503) or already gone
        try:
            refused = _post(url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0]
        except urllib.error.URLError:  # the listener is closed once drained
            refused = "connection refused"
        rest = _events(stream)
        code = proc.wait(timeout=60)
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first.startswith(b"data: ") and rest[-1] == "[DONE]" and len(rest) == 40  # the stream finished
    assert late is None or late[1]["status"] == "draining"
    assert refused in (503, "connection refused")
    assert code == 0 and "drained and stopped" in out
    assert 0 < cold["boot_s"] and 0 < cold["load_s"] and 0 < cold["warmup_s"]
    assert cold["total_s"] <= seen_ready + 0.1  # measured from the process's own start
    assert f"ready in {cold['total_s']:.1f} s" in out
    records = [json.loads(line) for line in log.read_text().splitlines()]
    served = [r for r in records if r.get("path") == "/v1/completions" and r["status"] == 200]
    assert len(served) == 1 and served[0]["tokens_out"] == 40
    assert {"event": "drained", "clean": True} in records


def test_slots_default_to_the_engine_batch_size(served_engine):
    from kiln.engine.serve.admission import SERVE_ADMISSION

    with ServerThread(served_engine, api_key=KEY, admission=SERVE_ADMISSION) as srv:
        slots = _metric(srv.url, "kiln:admission_slots")
    assert slots == served_engine.manifest["config"]["max_batch_size"]


@pytest.mark.timeout(180)
def test_kiln_serve_exit_is_bounded_by_the_drain_timeout_and_cut_answers_end_cleanly(tiny_model_dir, tmp_path):
    """SIGTERM with a stream and a non-streamed request that outlast --drain-timeout 1: the process
    exits within the timeout plus a second, the stream ends with an error event and [DONE], the
    other request gets a 503 JSON error, and the log counts both as cut."""
    import os

    from kiln.engine.serve.admission import CUT_AFTER_DRAIN_S
    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    port, log = _free_port(), tmp_path / "requests.log"
    url = f"http://127.0.0.1:{port}"
    kiln = str(Path(sys.executable).with_name("kiln"))
    proc = subprocess.Popen([kiln, "serve", str(engine_dir), "--port", str(port), "--request-log", str(log),
                             "--drain-timeout", "1"], env={**os.environ, "KILN_API_KEY": KEY},
                            stdout=subprocess.PIPE, text=True)
    long = {"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
    try:
        _wait_for(lambda: proc.poll() is None and (_health(url) or (0,))[0] == 200, timeout=120)
        stream = _open_stream(url, long)
        first = stream.readline()
        whole: list = []
        waiter = threading.Thread(target=lambda: whole.append(_post(url + "/v1/completions", long)))
        waiter.start()
        _wait_for(lambda: _metric(url, "kiln:num_requests_running") == 2)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = _events(stream)
        code = proc.wait(timeout=30)
        exited_in = time.monotonic() - signalled
        waiter.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0 and exited_in < 1 + CUT_AFTER_DRAIN_S + 1, exited_in
    assert first.startswith(b"data: ") and rest[-1] == "[DONE]" and len(rest) < 1000  # cut, not finished
    assert json.loads(rest[-2])["error"]["type"] == "service_unavailable"
    assert whole[0][0] == 503 and "drain timeout 1 s" in json.loads(whole[0][2])["error"]["message"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    cut = [r for r in records if r.get("path") == "/v1/completions"]
    assert sorted(r["status"] for r in cut) == [200, 503] and all("error" in r or r["status"] == 503 for r in cut)
    assert {"event": "drained", "clean": False} in records
