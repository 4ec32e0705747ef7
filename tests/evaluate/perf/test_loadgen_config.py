"""PerformanceConfig validation and the load shapes' stage plans."""

from __future__ import annotations

import itertools
import statistics

import pytest
from pydantic import ValidationError

from kiln.evaluate.perf.base import SHAPES, Stage
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.poisson import poisson_arrivals
from kiln.evaluate.perf.sweep import sweep_rates


def test_defaults_are_valid_and_closed_loop():
    cfg = PerformanceConfig()
    assert cfg.shape.kind == "concurrent" and cfg.output_tokens == 32 and cfg.duration_s == 20
    assert set(SHAPES.names()) == {"concurrent", "constant", "poisson", "sweep", "synchronous"}


def test_typos_and_bad_values_fail():
    with pytest.raises(ValidationError, match="extra"):
        PerformanceConfig.model_validate({"duration": 5})
    with pytest.raises(ValidationError, match="shape"):
        PerformanceConfig.model_validate({"shape": {"kind": "constnt", "rate": 5}})
    with pytest.raises(ValidationError, match="rates must be positive"):
        PerformanceConfig.model_validate({"shape": {"kind": "poisson", "rate": [5, 0]}})
    with pytest.raises(ValidationError, match="nothing is measured"):
        PerformanceConfig.model_validate({"duration_s": 3, "warmup": {"seconds": 2}, "cooldown": {"seconds": 1}})
    with pytest.raises(ValidationError, match="max_requests"):
        PerformanceConfig.model_validate({"max_requests": 10, "warmup": {"requests": 10}})
    with pytest.raises(ValidationError, match="token_id_range"):
        PerformanceConfig.model_validate({"workload": {"token_id_range": [10, 12]}})


def _stages(shape: dict) -> list[Stage]:
    cfg = PerformanceConfig.model_validate({"shape": shape})
    return list(SHAPES.create(cfg.shape, seed=1).stages())


def test_simple_shapes():
    assert [s.concurrency for s in _stages({"kind": "synchronous"})] == [1]
    assert [s.concurrency for s in _stages({"kind": "concurrent", "concurrency": [2, 8]})] == [2, 8]
    (constant,) = _stages({"kind": "constant", "rate": 4})
    assert constant.open_loop and constant.target_rate == 4
    assert list(itertools.islice(constant.arrivals, 4)) == [0, 0.25, 0.5, 0.75]


def test_poisson_is_seeded_with_the_right_mean():
    a = list(itertools.islice(poisson_arrivals(50, seed=3), 5001))
    assert a == list(itertools.islice(poisson_arrivals(50, seed=3), 5001))
    assert a != list(itertools.islice(poisson_arrivals(50, seed=4), 5001))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 50, rel=0.05)  # exponential: sd = mean


class _Probe:
    def __init__(self, throughput: float):
        self.request_throughput, self.error_summary = throughput, None


def test_sweep_probes_then_steps_up_to_the_maximum():
    cfg = PerformanceConfig.model_validate({"shape": {"kind": "sweep", "steps": 3, "max_concurrency": 16}})
    gen = SHAPES.create(cfg.shape).stages()
    sync = next(gen)
    assert sync.concurrency == 1
    peak = gen.send(_Probe(2.0))
    assert peak.concurrency == 16
    rest = [gen.send(_Probe(8.0))] + list(gen)
    assert [round(s.target_rate, 6) for s in rest] == [2.666667, 5.333333, 8.0]
    assert all(s.open_loop for s in rest)
    assert sweep_rates(5, 4, 2) == [2.5, 5.0]  # no batching gain: up to the synchronous rate, half of it first
