"""Who set the pace of an open-loop stage: the rate the server saw, and client- vs server-limited runs.

The fake engine records each request's arrival on its own clock (time.monotonic); on Linux that is
CLOCK_MONOTONIC, the clock of the generator's time.perf_counter, so the server's arrivals can be
counted over the generator's own measurement window.
"""

from __future__ import annotations

import time

import pytest

from kiln.engine.serve.fake import FakeEngineConfig, FakeServer
from kiln.evaluate.perf import workload as workload_mod
from kiln.evaluate.perf.client import RequestRecord
from kiln.evaluate.perf.config import SLO, PerformanceConfig
from kiln.evaluate.perf.metrics import achieved_rate, client_limited, find_knee, summarize
from kiln.evaluate.perf.runner import run_load


def _config(rate: float, duration: float, **kw) -> PerformanceConfig:
    base = {
        "shape": {"kind": "constant", "rate": rate},
        "duration_s": duration,
        "output_tokens": 10,
        "warmup": {"seconds": 0.3},
        "cooldown": {"seconds": 0.2},
        "workload": {"input_tokens": {"mean": 16}},
    }
    return PerformanceConfig.model_validate({**base, **kw})


@pytest.fixture(scope="module")
def instant_server():
    """Unlimited capacity and no latency: whatever rate the client sends, the server can take."""
    with FakeServer(FakeEngineConfig(ttft_ms=0, tpot_ms=0)) as server:
        yield server


def _same_clock() -> None:
    perf, mono = time.get_clock_info("perf_counter"), time.get_clock_info("monotonic")
    assert perf.implementation == mono.implementation, "client and server clocks differ: compare rates another way"


def _server_rate(server: FakeServer, window: tuple[float, float]) -> float:
    w0, w1 = window
    return achieved_rate([t for t in server.arrivals(reset=True) if w0 <= t < w1])


def test_achieved_rate_is_what_the_server_saw_when_the_client_keeps_up(instant_server):
    _same_clock()
    instant_server.arrivals(reset=True)
    result = run_load(instant_server.url, _config(60, 2.5))
    stage, s = result.stages[0], result.summary
    assert s.achieved_rate == pytest.approx(_server_rate(instant_server, stage.window), rel=0.02)
    assert s.achieved_rate == pytest.approx(60, rel=0.02)
    assert set(s.send_lag_ms) == {"p50", "p99", "max"} and 0 <= s.send_lag_ms["p50"] <= s.send_lag_ms["max"]


def test_a_slow_client_is_client_limited_and_reports_what_it_really_sent(instant_server, monkeypatch):
    _same_clock()
    original = workload_mod.Workload.request

    def slow_request(self, i, salt=""):
        time.sleep(0.01)  # blocks the client's event loop: it cannot send more than ~100/s
        return original(self, i, salt)

    monkeypatch.setattr(workload_mod.Workload, "request", slow_request)
    instant_server.arrivals(reset=True)
    result = run_load(instant_server.url, _config(200, 1.5, saturation={"max_lateness_s": 30}))
    stage, s = result.stages[0], result.summary
    assert s.achieved_rate < 110  # not the 200 asked for ...
    assert s.achieved_rate == pytest.approx(_server_rate(instant_server, stage.window), rel=0.05)  # ... what arrived
    assert s.limited_by == "client" and client_limited(s) and client_limited({"limited_by": "client"})
    assert s.send_lag_ms["p99"] > 50
    assert not (s.stopped_early or "").startswith("over-saturated")


def test_client_behind_while_in_flight_grows_is_not_blamed_on_the_server(small_server, monkeypatch):
    # The server can finish ~14/s and the client can send ~35/s of the 60/s asked: requests in
    # flight grow, and so does the send lag. The stage stops; the label blames the client.
    original = workload_mod.Workload.request

    def slow_request(self, i, salt=""):
        time.sleep(1 / 35)
        return original(self, i, salt)

    monkeypatch.setattr(workload_mod.Workload, "request", slow_request)
    rule = {"check_interval_s": 0.25, "rising_checks": 3, "min_in_flight": 8, "max_lateness_s": 30}
    s = run_load(small_server.url, _config(60, 30.0, saturation=rule, warmup={"seconds": 0.5})).summary
    assert s.stopped_early and s.stopped_early.startswith("client-limited")
    assert "in flight rose" in s.stopped_early and "behind schedule" in s.stopped_early
    assert s.limited_by == "client" and client_limited(s)


def test_server_limited_run_is_labelled_server_with_sends_on_time(small_server):
    rule = {"check_interval_s": 0.25, "rising_checks": 3, "min_in_flight": 8}
    result = run_load(small_server.url, _config(60, 30.0, saturation=rule, warmup={"seconds": 0.5}))
    s = result.summary
    assert s.stopped_early and s.stopped_early.startswith("over-saturated") and "sends were on time" in s.stopped_early
    assert s.limited_by == "server" and not client_limited(s)
    assert s.achieved_rate == pytest.approx(60, rel=0.05)  # the client sent the target; the server fell behind


def test_a_client_that_stalls_once_and_catches_up_does_not_take_the_blame(small_server, monkeypatch):
    # A busy CI runner once stalled the client 94 ms while a saturated server's queue grew, and the
    # stop blamed the client. A stall it catches up from is not a client that cannot send the rate.
    original, stalled = workload_mod.Workload.request, []

    def stall_once(self, i, salt=""):
        if i == 40 and not stalled:  # after the 0.5 s warm-up, inside the checks that see the queue rise
            stalled.append(i)
            time.sleep(0.15)
        return original(self, i, salt)

    monkeypatch.setattr(workload_mod.Workload, "request", stall_once)
    rule = {"check_interval_s": 0.25, "rising_checks": 3, "min_in_flight": 8}
    s = run_load(small_server.url, _config(60, 30.0, saturation=rule, warmup={"seconds": 0.5})).summary
    assert stalled and s.send_lag_ms["max"] > 100  # the stall happened and was seen
    assert s.stopped_early and s.stopped_early.startswith("over-saturated"), s.stopped_early
    assert s.limited_by == "server" and not client_limited(s)


def test_an_absurd_rate_is_client_limited(instant_server):
    # 3000 req/s was absurd on the 2-core CI machines until one sent all of it on time (send lag p99
    # 2.4 ms, 2026-12-02); no Python client sends 100,000 a second, and stopping at 0.3 s late bounds the run.
    rule = {"max_lateness_s": 0.3, "check_interval_s": 0.1}
    s = run_load(instant_server.url, _config(100_000, 1.5, saturation=rule)).summary
    assert s.limited_by == "client" and s.stopped_early and s.stopped_early.startswith("client-limited")


def test_closed_loop_and_light_open_loop_are_not_limited(instant_server):
    closed = run_load(instant_server.url, _config(1, 1.0, shape={"kind": "concurrent", "concurrency": 2})).summary
    assert closed.limited_by is None
    light = run_load(instant_server.url, _config(20, 1.5)).summary
    assert light.limited_by is None and light.stopped_early is None


def _stage(rate: float, ttft_s: float, lag_per_request_s: float = 0.0, stopped: str | None = None):
    """A summarized 10 s open-loop stage of hand-made records; each send `lag_per_request_s` later than the last."""
    recs = []
    for i in range(int(rate * 10)):
        sched = i / rate
        rec = RequestRecord(str(i), scheduled=sched, sent=sched + i * lag_per_request_s)
        rec.chunk_times = [rec.sent + ttft_s, rec.sent + ttft_s + 0.01]
        rec.done, rec.output_tokens = rec.chunk_times[-1], 2
        recs.append(rec)
    return summarize(recs, (1.0, 9.0), SLO(), label=f"r{rate:g}", target_rate=rate, stopped_early=stopped)


def test_limited_by_from_the_send_lag_and_the_stop_reason():
    on_time = _stage(10, 0.05)
    assert on_time.limited_by is None and on_time.send_lag_ms["max"] == pytest.approx(0)
    late = _stage(10, 0.05, lag_per_request_s=0.001)  # 0.1 s behind after 100 requests
    assert late.limited_by == "client" and late.send_lag_ms["p99"] > 50
    assert late.achieved_rate < 10  # from the real sends, not the schedule
    assert _stage(10, 0.05, stopped="over-saturated: ...").limited_by == "server"
    assert _stage(10, 0.05, stopped="client-limited: ...").limited_by == "client"
    # Just inside the tolerance is on time: 40 ms of lag at the last request.
    assert _stage(10, 0.05, lag_per_request_s=0.0004).limited_by is None
    flat = late.flat()
    assert flat["send_lag_p99_ms"] == late.send_lag_ms["p99"] and "limited_by" not in flat


def test_knee_ignores_client_limited_stages():
    stages = [_stage(2, 0.050), _stage(4, 0.052), _stage(6, 0.9, lag_per_request_s=0.002), _stage(8, 0.9)]
    knee = find_knee(stages)
    assert knee is not None and knee.rate == 4 and "TTFT" in knee.reason  # 8/s is past it; 6/s says nothing
    flat_top = [_stage(2, 0.050), _stage(4, 0.052), _stage(6, 0.9, lag_per_request_s=0.002)]
    knee = find_knee(flat_top)
    assert knee.rate == 4 and "1 client-limited stage(s) skipped" in knee.reason
    assert find_knee([_stage(2, 0.05), _stage(4, 0.05, lag_per_request_s=0.002)]) is None  # one on-time stage: no curve


def test_once_sending_has_ended_the_client_is_not_behind_while_requests_drain():
    """The open-loop sender's last due time is not left as lateness that keeps growing through the drain."""
    import asyncio

    from kiln.evaluate.perf.base import Stage
    from kiln.evaluate.perf.driver import _behind_now, _Drive, _lag_since_last_check, _open_loop, _State

    class SlowReplies:  # the bytes go out at once; the reply takes a while
        async def send(self, rec: RequestRecord, body: dict) -> None:
            rec.sent = time.perf_counter()
            await asyncio.sleep(0.5)
            rec.done = time.perf_counter()

    async def drive() -> float:
        cfg = _config(rate=50, duration=5.0, max_requests=3)
        state, t0 = _State(), time.perf_counter()
        stage = Stage("s", arrivals=iter([0.0, 0.01, 0.02, 0.03]))
        d = _Drive(SlowReplies(), stage, workload_mod.Workload(cfg), cfg, "t", t0, [], state)
        await _open_loop(d)
        await asyncio.sleep(0.3)  # the three requests are still in flight: the drain
        _lag_since_last_check(d.records, state)  # as the watcher does before asking
        behind = _behind_now(d.records, state)
        await asyncio.gather(*state.in_flight)
        return behind

    assert asyncio.run(drive()) == 0.0
