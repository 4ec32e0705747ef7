"""Baseline against candidate, interleaved: ratios with intervals, on servers of known speed."""

from __future__ import annotations

import pytest

from kiln.engine.serve.fake import FakeEngineConfig, FakeServer
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.runner import compare_interleaved
from kiln.core.errors import BadInput


def _config(shape: dict) -> PerformanceConfig:
    return PerformanceConfig.model_validate(
        {
            "shape": shape,
            "duration_s": 1.2,
            "warmup": {"seconds": 0.3},
            "cooldown": {"seconds": 0.2},
            "output_tokens": 10,
            "workload": {"input_tokens": {"mean": 16}},
            "repeats": 2,
        }
    )


def test_interleaved_comparison_finds_a_slower_candidate():
    with (
        FakeServer(FakeEngineConfig(ttft_ms=50, tpot_ms=10, model="base")) as a,
        FakeServer(FakeEngineConfig(ttft_ms=50, tpot_ms=10, slowdown=1.5, model="cand")) as b,
    ):
        cmp = compare_interleaved(a.url, b.url, _config({"kind": "concurrent", "concurrency": 4}))
    assert [r.model for r in cmp.baseline] == ["base", "base"] and [r.model for r in cmp.candidate] == ["cand", "cand"]
    tpot = cmp.ratio("tpot_p50_ms")
    assert len(tpot.ratios) == 2 and tpot.ratio == pytest.approx(1.5, rel=0.05)
    assert tpot.low is not None and tpot.low <= tpot.ratio <= tpot.high
    assert cmp.ratio("ttft_p50_ms").ratio == pytest.approx(1.5, rel=0.1)
    assert cmp.ratio("output_token_throughput").ratio < 0.8  # closed loop: slower server, fewer tokens
    assert "tpot_p50_ms" in cmp.table()
    # Same requests in each pair: the arms saw identical prompts.
    first_a = cmp.baseline[0].stages[0].records[0]
    first_b = cmp.candidate[0].stages[0].records[0]
    assert first_a.request_id == first_b.request_id


def test_comparison_refuses_loads_that_differ_per_arm():
    with pytest.raises(BadInput, match="one fixed load"):
        compare_interleaved("http://127.0.0.1:9", "http://127.0.0.1:9", _config({"kind": "sweep"}))
    with pytest.raises(BadInput, match="one fixed load"):
        compare_interleaved("http://127.0.0.1:9", "http://127.0.0.1:9", _config({"kind": "constant", "rate": [1, 2]}))
