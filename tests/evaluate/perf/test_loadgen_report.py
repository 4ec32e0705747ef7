"""A short sweep end to end: stages, knee, figures, JSONL records."""

from __future__ import annotations

import json

from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.plots import ceiling_vs_measured, result_figures
from kiln.evaluate.perf.runner import run_load
from kiln.evaluate.roofline import ceiling_table


def test_sweep_report(small_server, tmp_path):
    cfg = PerformanceConfig.model_validate(
        {
            "shape": {"kind": "sweep", "steps": 2, "max_concurrency": 8},
            "duration_s": 1.5,
            "warmup": {"seconds": 0.3},
            "cooldown": {"seconds": 0.2},
            "output_tokens": 10,
            "workload": {"input_tokens": {"mean": 16}},
            "price_per_hour": 2.0,
        }
    )
    result = run_load(small_server.url, cfg)
    labels = [s.label for s in result.stages]
    assert labels[0] == "synchronous" and labels[1] == "throughput@8" and len(labels) == 4
    sync, peak, *steps = result.summaries
    assert sync.request_throughput < peak.request_throughput  # two slots beat one user
    assert steps[-1].target_rate == peak.request_throughput  # the sweep steps up to the measured maximum
    assert all(s.cost_per_1m_output_tokens for s in result.summaries)
    figs = result_figures(result.summaries, result.knee, tmp_path)
    assert set(figs) == {"latency_vs_rate", "latency_throughput"}
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 10_000
    assert (tmp_path / "latency_throughput.png").stat().st_size > 10_000
    result.write_jsonl(tmp_path / "records.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(rows) == sum(len(s.records) for s in result.stages)
    assert {
        "request_id",
        "scheduled",
        "sent",
        "queue_time",
        "ttft",
        "itl",
        "tpot",
        "e2e",
        "input_tokens",
        "output_tokens",
        "error",
        "stage",
    } <= set(rows[0])
    json.dumps(result.to_dict())  # serializable as it is


def test_ceiling_figure(tmp_path):
    rows = ceiling_table(16e9, 0.27e9, 3350, (1, 8, 64), measured_tpot_ms={1: 6.0, 8: 7.0})
    fig = ceiling_vs_measured(rows, tmp_path / "ceiling.png")
    assert len(fig.axes[0].lines) == 2 and (tmp_path / "ceiling.png").stat().st_size > 10_000
