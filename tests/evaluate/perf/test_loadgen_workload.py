"""Workloads: unique and seeded prompts, shared prefixes, datasets, request bodies."""

from __future__ import annotations

import json
import statistics

import pytest

from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.workload import Workload, load_prompts
from kiln.core.errors import BadInput


def _work(**kw) -> Workload:
    return Workload(PerformanceConfig.model_validate(kw))


def test_synthetic_prompts_are_unique_seeded_and_sized():
    w = _work(workload={"input_tokens": {"mean": 64}}, seed=7)
    prompts = [w.prompt(i, "s0") for i in range(500)]
    assert all(len(p) == 64 and all(1000 <= t < 10000 for t in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 500
    assert prompts == [_work(workload={"input_tokens": {"mean": 64}}, seed=7).prompt(i, "s0") for i in range(500)]
    assert prompts != [_work(workload={"input_tokens": {"mean": 64}}, seed=8).prompt(i, "s0") for i in range(500)]
    # Another stage or repeat (salt) gets other prompts, so a prefix cache cannot carry over.
    assert not {tuple(p) for p in prompts} & {tuple(w.prompt(i, "s1")) for i in range(500)}


def test_unique_marker_makes_even_tiny_prompts_distinct():
    w = _work(workload={"input_tokens": {"mean": 3}, "token_id_range": [100, 116]})
    assert len({tuple(w.prompt(i)) for i in range(256)}) == 256
    # Without the marker, 256 random 3-token prompts over 16 ids collide (4,096 possible).
    w = _work(workload={"input_tokens": {"mean": 3}, "token_id_range": [100, 116], "unique": False})
    assert len({tuple(w.prompt(i)) for i in range(256)}) < 256


def test_length_distribution():
    w = _work(workload={"input_tokens": {"mean": 100, "stdev": 20, "min": 50, "max": 130}})
    lengths = [len(w.prompt(i)) for i in range(2000)]
    assert 50 <= min(lengths) and max(lengths) <= 130
    assert statistics.mean(lengths) == pytest.approx(100, abs=3)
    assert statistics.stdev(lengths) == pytest.approx(20, rel=0.2)


def test_shared_prefix_fraction():
    w = _work(workload={"input_tokens": {"mean": 100}, "shared_prefix_fraction": 0.4})
    a, b = w.prompt(1), w.prompt(2)
    assert a[:40] == b[:40] and a[40:43] != b[40:43]  # 40 shared tokens, then the unique marker


def test_chat_synthetic_prompts_are_text():
    w = _work(endpoint="chat", workload={"input_tokens": {"mean": 20}})
    body, n_in = w.request(3, "s0")
    content = body["messages"][0]["content"]
    assert isinstance(content, str) and len(content.split()) == 20 and "[s0#3]" in content
    assert n_in is None


def test_request_body_fixes_output_length():
    body, n_in = _work(output_tokens=48, workload={"input_tokens": {"mean": 16}}).request(0)
    assert body["max_tokens"] == 48 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and n_in == 16


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question number {i}"}) for i in range(5)) + "\n")
    w = _work(workload={"dataset": str(path)})
    prompts = [w.prompt(i, "s0") for i in range(10)]
    assert len(set(prompts)) == 10  # cycles through 5 prompts, each made unique
    assert all(p.startswith("[s0#") and "question number" in p for p in prompts)
    shared = _work(workload={"dataset": str(path), "shared_prefix_fraction": 0.5})
    assert shared.prompt(0).split()[:3] == shared.prompt(1).split()[:3]


def test_bad_dataset_is_named(tmp_path):
    with pytest.raises(BadInput, match="workload.dataset"):
        _work(workload={"dataset": str(tmp_path / "missing.jsonl")})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(BadInput, match="line 2"):
        _work(workload={"dataset": str(bad)})


def test_demo_dataset_is_gsm8k():
    prompts = load_prompts(PerformanceConfig.model_validate({"workload": {"dataset": "demo"}}).workload)
    assert len(prompts) == 1319 and prompts[0].startswith("Janet")
