"""Against a server with known timing, kiln must recover it: the honesty tests of the generator."""

from __future__ import annotations

import pytest

from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.runner import run_load

OUT = 24  # long enough that one late-read first or last chunk moves TPOT by < 2%


def _config(shape: dict, **kw) -> PerformanceConfig:
    base = {
        "shape": shape,
        "duration_s": 4.5,
        "warmup": {"seconds": 1.4},
        "cooldown": {"seconds": 1.4},
        "output_tokens": OUT,
        "workload": {"input_tokens": {"mean": 32}},
    }
    return PerformanceConfig.model_validate({**base, **kw})


def test_recovers_ttft_tpot_and_open_loop_rate(steady_server):
    ttft_ms, tpot_ms = steady_server.config.ttft_ms, steady_server.config.tpot_ms
    result = run_load(steady_server.url, _config({"kind": "constant", "rate": 20}))
    s = result.summary
    assert s.errors == 0 and s.completed == s.requests >= 30
    # The set values are the truth. Never below it: loopback and parsing only add time.
    assert ttft_ms <= s.ttft_ms["p50"] <= ttft_ms * 1.02
    assert s.tpot_ms["p50"] == pytest.approx(tpot_ms, rel=0.02)
    # One late chunk lengthens one gap and shortens the next: the mean holds, the median jitters.
    assert s.itl_ms["mean"] == pytest.approx(tpot_ms, rel=0.02)
    assert s.itl_ms["p50"] == pytest.approx(tpot_ms, rel=0.05)
    assert s.achieved_rate == pytest.approx(20, rel=0.01)
    # Completions and tokens counted in a 1.7 s window: +-1 request of quantization.
    assert s.request_throughput == pytest.approx(20, rel=0.1)
    assert s.output_token_throughput == pytest.approx(20 * OUT, rel=0.1)
    assert all(r.output_tokens == OUT and r.input_tokens == 32 for st in result.stages for r in st.records)
    assert result.model == "kiln-fake"


def test_closed_loop_keeps_its_users_busy(steady_server):
    ttft_ms, tpot_ms = steady_server.config.ttft_ms, steady_server.config.tpot_ms
    s = run_load(steady_server.url, _config({"kind": "concurrent", "concurrency": 4})).summary
    e2e_s = (ttft_ms + (OUT - 1) * tpot_ms) / 1000
    assert s.request_throughput == pytest.approx(4 / e2e_s, rel=0.35)  # only ~5 completions in the window
    assert s.queue_ms["p50"] < 1  # a closed-loop user is never late: it sends when it is free
    assert s.tpot_ms["p50"] == pytest.approx(tpot_ms, rel=0.02)
    assert s.target_rate is None and s.concurrency == 4
