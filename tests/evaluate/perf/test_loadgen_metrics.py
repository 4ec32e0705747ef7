"""Metrics math on hand-made records: percentiles, windows, goodput, cost, knee, ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.evaluate.perf.client import RequestRecord
from kiln.evaluate.perf.compare import ratio_estimates, ratio_interval
from kiln.evaluate.perf.config import SLO
from kiln.evaluate.perf.driver import measurement_window
from kiln.evaluate.perf.config import Trim
from kiln.evaluate.perf.metrics import Summary, achieved_rate, describe_ms, find_knee, summarize


def _record(i: int, sent: float, ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    times = [sent + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    rec = RequestRecord(str(i), scheduled=sent, sent=sent, chunk_times=[] if error else times, error=error)
    rec.done = times[-1]
    rec.output_tokens = 0 if error else len(times)
    return rec


def test_record_latencies():
    r = _record(0, 10.0, 0.2, [0.01, 0.03, 0.02])
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(0.26)
    assert r.itl == pytest.approx([0.01, 0.03, 0.02])
    assert r.tpot == pytest.approx(0.06 / 3)  # (e2e - ttft) / (tokens - 1): TTFT is not in it
    one = _record(1, 0.0, 0.1, [])
    assert one.tpot is None and one.itl == []


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    values = rng.lognormal(-3, 0.5, size=501)
    d = describe_ms(values)
    for p in (50, 90, 95, 99):
        assert d[f"p{p}"] == pytest.approx(np.percentile(values * 1000, p))
    assert d["mean"] == pytest.approx(values.mean() * 1000)
    assert math.isnan(describe_ms([])["p50"])


def test_summary_counts_window_goodput_cost_errors():
    # 100 requests, one every 0.1 s from t=0; TTFT alternates 0.1 / 0.5 s; 5 tokens 0.02 s apart.
    recs = [_record(i, i * 0.1, 0.1 if i % 2 else 0.5, [0.02] * 4) for i in range(100)]
    recs[50] = _record(50, 5.0, 0, [], error="HTTP 500: boom")
    recs[52].error = "cancelled"
    slo = SLO(ttft_p95_ms=200, tpot_p95_ms=25)
    s = summarize(recs, (2.0, 8.0), slo, target_rate=10, price_per_hour=3.6)
    inside = [r for r in recs if 2.0 <= r.scheduled < 8.0]
    assert s.requests == len(inside) == 60
    assert s.errors == 1 and s.cancelled == 1 and s.error_rate == pytest.approx(1 / 59)
    ok = [r for r in inside if r.ok]
    assert s.completed == len(ok) == 58
    assert s.ttft_ms["p50"] == pytest.approx(np.percentile([r.ttft * 1000 for r in ok], 50))
    assert s.tpot_ms["p95"] == pytest.approx(20)
    # Goodput: only the odd requests (TTFT 0.1 s) meet the 200 ms SLO; per second of window.
    assert s.goodput == pytest.approx(sum(1 for r in ok if r.ttft < 0.2) / 6.0)
    assert s.slo_attainment == pytest.approx(sum(1 for r in ok if r.ttft < 0.2) / 58)
    assert not s.slo_met  # p95 TTFT is 500 ms
    assert s.achieved_rate == pytest.approx(10)
    # Tokens arriving in [2, 8): 5 per request at 10 req/s, minus the failed and the cancelled one.
    assert s.output_token_throughput == pytest.approx(50 - 10 / 6, rel=0.02)
    assert s.cost_per_1m_output_tokens == pytest.approx(3.6 / (s.output_token_throughput * 3600) * 1e6)
    flat = s.flat()
    assert flat["ttft_p95_ms"] == s.ttft_ms["p95"] and flat["error_rate"] == s.error_rate


def test_throughput_counts_what_finished_in_the_window_not_the_run():
    # A generator that divides completions by the whole run (drain included) undercounts;
    # counting completions inside a window with load on both sides does not.
    recs = [_record(i, i * 0.05, 0.3, [0.01] * 9) for i in range(200)]  # 20 req/s for 10 s
    s = summarize(recs, (1.0, 9.0), SLO())
    assert s.request_throughput == pytest.approx(20, rel=0.01)
    assert s.output_token_throughput == pytest.approx(200, rel=0.01)


def test_flow_window_waits_for_the_first_completion_when_warmup_is_short():
    recs = [_record(i, i * 0.05, 0.9, [0.01] * 9) for i in range(100)]  # e2e 0.99 s, 20 req/s
    s = summarize(recs, (0.1, 4.0), SLO())  # warm-up shorter than one request
    assert s.request_throughput == pytest.approx(20, rel=0.05)


def test_throughput_under_overload_is_the_service_rate():
    # 40 req/s offered, served one after another every 0.1 s: latency grows without bound,
    # and completions still flow at 10/s from the first one on.
    recs = []
    for i in range(80):
        rec = RequestRecord(str(i), scheduled=i * 0.025, sent=i * 0.025)
        rec.chunk_times = [0.1 * (i + 1)]
        rec.done, rec.output_tokens = rec.chunk_times[-1], 1
        recs.append(rec)
    s = summarize(recs, (0.3, 1.8), SLO())
    assert s.request_throughput == pytest.approx(10, rel=0.1)
    assert s.achieved_rate == pytest.approx(40)


def test_achieved_rate_is_from_spacing():
    assert achieved_rate([0.0, 0.1, 0.2, 0.3]) == pytest.approx(10)
    assert math.isnan(achieved_rate([1.0]))


def test_measurement_window_trims():
    recs = [RequestRecord(str(i), scheduled=float(i)) for i in range(10)]
    assert measurement_window(recs, 0.0, 10.0, Trim(seconds=2), Trim(seconds=3)) == (2.0, 7.0)
    assert measurement_window(recs, 0.0, 10.0, Trim(requests=4), Trim(requests=2)) == (4.0, 8.0)
    # Both given: the later start and the earlier end win.
    assert measurement_window(recs, 0.0, 10.0, Trim(seconds=1, requests=3), Trim(seconds=4, requests=1)) == (3.0, 6.0)


def _summary(
    label: str, rate: float | None, ttft_p50: float, concurrency: int | None = None, stopped: str | None = None
) -> Summary:
    d = {"mean": ttft_p50, "p50": ttft_p50, "p90": ttft_p50, "p95": ttft_p50, "p99": ttft_p50}
    return Summary(
        label,
        10,
        10,
        10,
        0,
        0,
        rate,
        concurrency,
        rate or 1,
        rate or 1,
        100,
        1,
        1,
        True,
        d,
        d,
        d,
        d,
        d,
        stopped_early=stopped,
    )


def test_knee_is_last_rate_before_latency_climbs():
    stages = [
        _summary("sync", None, 50, concurrency=1),
        _summary("a", 2, 52),
        _summary("b", 4, 60),
        _summary("c", 6, 74),
        _summary("d", 8, 200),
        _summary("e", 10, 900),
    ]
    knee = find_knee(stages)
    assert knee is not None and knee.rate == 6 and knee.label == "c" and knee.baseline_ms == 50
    assert "200" in knee.reason
    stopped = stages[:3] + [_summary("c", 6, 60, stopped="over-saturated: ...")]
    assert find_knee(stopped).rate == 4
    assert find_knee(stages[:2]) is None  # one open-loop stage: no curve, no knee
    assert find_knee([_summary("a", 2, 300), _summary("b", 4, 310)], factor=1.5).rate == 4


def test_ratio_interval_is_student_t_on_log_ratios():
    from scipy import stats

    ratios = [1.10, 1.20, 1.15]
    mean, low, high = ratio_interval(ratios)
    logs = np.log(ratios)
    half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
    assert mean == pytest.approx(math.exp(logs.mean()))
    assert (low, high) == pytest.approx((math.exp(logs.mean() - half), math.exp(logs.mean() + half)))
    assert ratio_interval([1.2])[1:] == (None, None)


def test_ratio_estimates_pair_repeats():
    base = [_summary("x", 10, 50), _summary("x", 10, 60)]
    cand = [_summary("x", 10, 75), _summary("x", 10, 90)]
    ttft = next(e for e in ratio_estimates(base, cand) if e.metric == "ttft_p50_ms")
    assert ttft.ratios == pytest.approx([1.5, 1.5]) and ttft.ratio == pytest.approx(1.5)
    assert not ttft.higher_is_better
