"""Open-loop load against a server that cannot keep up: queueing shows, and the run stops."""

from __future__ import annotations

import time

from kiln.evaluate.perf import workload as workload_mod
from kiln.evaluate.perf.config import PerformanceConfig
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


def test_queueing_shows_in_ttft_when_rate_exceeds_capacity(small_server):
    light = run_load(small_server.url, _config(5, 2.0)).summary
    heavy = run_load(small_server.url, _config(40, 1.5, saturation={"enabled": False})).summary
    assert light.ttft_ms["p50"] < 80  # 50 ms set, no queue at 5 req/s
    assert heavy.ttft_ms["p50"] > 4 * light.ttft_ms["p50"]  # requests wait for one of two slots
    assert heavy.tpot_ms["p50"] < 13  # queueing is in TTFT, not in the stream
    assert heavy.achieved_rate > 39  # open loop: the client kept sending at the target anyway
    assert 8 < heavy.request_throughput < 16  # while the server finished at most ~14/s
    assert heavy.errors == 0 and heavy.stopped_early is None


def test_stops_early_when_over_saturated(small_server):
    rule = {"check_interval_s": 0.25, "rising_checks": 3, "min_in_flight": 8}
    t = time.perf_counter()
    result = run_load(small_server.url, _config(60, 30.0, saturation=rule, warmup={"seconds": 0.5}))
    wall = time.perf_counter() - t
    s = result.summary
    assert s.stopped_early and s.stopped_early.startswith("over-saturated")
    assert wall < 10  # not the 30 s asked for
    assert s.cancelled > 0  # what was still queued was cancelled, and is not counted as an error
    assert s.errors == 0


def test_does_not_stop_a_load_the_server_can_take(small_server):
    rule = {"check_interval_s": 0.25, "rising_checks": 3, "min_in_flight": 4}
    s = run_load(small_server.url, _config(8, 3.0, saturation=rule)).summary
    assert s.stopped_early is None and s.cancelled == 0 and s.errors == 0


def test_stops_when_the_client_falls_behind(small_server, monkeypatch):
    original = workload_mod.Workload.request

    def slow_request(self, i, salt=""):
        time.sleep(0.05)  # a client too slow for 50 req/s: it blocks its own event loop
        return original(self, i, salt)

    monkeypatch.setattr(workload_mod.Workload, "request", slow_request)
    rule = {"check_interval_s": 0.1, "max_lateness_s": 0.3}
    s = run_load(small_server.url, _config(50, 20.0, saturation=rule)).summary
    assert s.stopped_early and "behind schedule" in s.stopped_early


def test_warmup_and_cooldown_requests_are_excluded(small_server):
    cfg = _config(10, 2.0, warmup={"requests": 5}, cooldown={"requests": 3})
    result = run_load(small_server.url, cfg)
    stage = result.stages[0]
    order = sorted(stage.records, key=lambda r: r.scheduled)
    assert stage.summary.requests == len(order) - 8
    w0, w1 = stage.window
    assert order[4].scheduled < w0 <= order[5].scheduled  # first five out, sixth in
    assert order[-4].scheduled < w1 <= order[-3].scheduled  # last three out


def test_warmup_by_time_is_excluded(small_server):
    result = run_load(small_server.url, _config(10, 2.0, warmup={"seconds": 0.8}, cooldown={"seconds": 0.4}))
    stage = result.stages[0]
    inside = [r for r in stage.records if stage.t0 + 0.8 <= r.scheduled < stage.t0 + 1.6]
    assert stage.summary.requests == len(inside) == 8
