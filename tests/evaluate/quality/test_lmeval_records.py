"""run_lmeval's per-document records: keyed by doc_id, consistent with the aggregates, joinable."""

from __future__ import annotations

import json
import math

import pytest
from lm_eval.api.instance import Instance

from kiln.evaluate.quality.base import read_records
from kiln.evaluate.quality.lmeval import LmEvalConfig, evaluate_lmeval, prepare_tasks, run_lmeval
from kiln.evaluate.quality.lmeval_adapter import KilnLM
from kiln.evaluate.tasks import render_shipped
from kiln.core.errors import BadInput
from kiln.core.metrics import METRICS
from tests.evaluate.quality.lmeval_data import write_data

LIMIT = 6


@pytest.fixture(scope="module")
def results(engine, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lmeval-out")
    return out, {r.name: r for r in evaluate_lmeval(engine, LmEvalConfig(limit=LIMIT), out, data)}


def test_every_task_has_one_record_per_document_keyed_by_doc_id(results, data):
    out, by_task = results
    assert sorted(by_task) == ["gsm8k_answer", "heldout", "word_swap"]
    swaps = [json.loads(x) for x in data.word_swap.read_text().splitlines()]
    for name, result in by_task.items():
        assert [r["doc_id"] for r in result.records] == list(range(LIMIT))
        assert read_records(out / f"{name}.jsonl") == json.loads(json.dumps(result.records))
        assert result.metrics[f"{name}_documents"] == LIMIT
    assert [r["id"] for r in by_task["word_swap"].records] == [s["id"] for s in swaps[:LIMIT]]
    summary = json.loads((out / "lmeval.json").read_text())
    assert set(summary["fingerprints"]) == set(by_task) and summary["limit"] == LIMIT


def test_word_swap_records_are_zero_one_and_average_to_the_aggregate(results):
    result = results[1]["word_swap"]
    for r in result.records:
        assert r["word_swap_acc"] == float(max(range(2), key=lambda i: r["logprobs"][i]) == r["target"])
    acc = [r["word_swap_acc"] for r in result.records]
    assert result.metrics["word_swap_acc"] == pytest.approx(sum(acc) / len(acc))
    assert METRICS["word_swap_acc"].higher_is_better and METRICS["word_swap_acc"].kind == "quality"


def test_rolling_records_rebuild_the_perplexity_aggregates(results, engine):
    result = results[1]["heldout"]
    nll = sum(r["nll"] for r in result.records)
    words, n_bytes, tokens = (sum(r[k] for r in result.records) for k in ("words", "bytes", "tokens"))
    m = result.metrics
    assert m["heldout_word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-6)
    assert m["heldout_byte_perplexity"] == pytest.approx(math.exp(nll / n_bytes), rel=1e-6)
    assert m["heldout_bits_per_byte"] == pytest.approx(nll / n_bytes / math.log(2), rel=1e-6)
    assert m["heldout_token_perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    first = result.records[0]
    (direct,) = KilnLM(engine=engine).loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (first["doc"]["text"],), 0)])
    assert first["loglikelihood"] == pytest.approx(direct, abs=1e-3)
    assert first["heldout_word_perplexity"] == pytest.approx(math.exp(first["nll"] / first["words"]))
    assert not METRICS["heldout_word_perplexity"].higher_is_better


def test_answer_records_hold_the_adapters_loglikelihood(results, engine):
    result = results[1]["gsm8k_answer"]
    lm = KilnLM(engine=engine)
    docs = [r["doc"] for r in result.records]
    direct = lm.loglikelihood([Instance("loglikelihood", d, (d["context"], d["continuation"]), 0) for d in docs])
    for r, (ll, _), d in zip(result.records, direct, docs, strict=True):
        assert r["gsm8k_answer_logprob"] == pytest.approx(ll, abs=1e-3)
        assert r["tokens"] == len(lm.encode_request(d["context"], d["continuation"])[1])
        assert r["gsm8k_answer_logprob_per_token"] == pytest.approx(ll / r["tokens"], abs=1e-4)
    total = sum(r["loglikelihood"] for r in result.records) / sum(r["tokens"] for r in result.records)
    assert result.metrics["gsm8k_answer_logprob_per_token"] == pytest.approx(total)


def test_repeated_documents_stay_apart_by_doc_id(engine, tmp_path):
    data = write_data(tmp_path / "data", swaps=4, repeat_first=3)
    tasks = prepare_tasks(["word_swap"], tmp_path / "w", data)
    base = run_lmeval(engine, tasks.names, tasks.include_paths, None, tmp_path / "a")[0]
    cand = run_lmeval(engine, tasks.names, tasks.include_paths, None, tmp_path / "b", batch_size=1)[0]
    docs = [json.dumps(r["doc"], sort_keys=True) for r in base.records]
    assert len(docs) == 7 and len(set(docs)) == 4  # identical documents (same doc_hash in lm-eval)
    joined = {k: (v, cand.column("word_swap_acc")[k]) for k, v in base.column("word_swap_acc").items()}
    assert len(joined) == 7
    assert all(a == b for a, b in joined.values())


def test_user_task_metrics_are_declared_with_lm_evals_direction(engine, data, tmp_path):
    rendered = render_shipped(["word_swap"], data, tmp_path / "r") / "word_swap.yaml"
    mine = tmp_path / "mine" / "swap_norm.yaml"
    mine.parent.mkdir()
    mine.write_text(rendered.read_text().replace("task: word_swap", "task: swap_norm")
                    .replace("metric: acc\n", "metric: acc_norm\n"))
    (result,) = evaluate_lmeval(engine, LmEvalConfig(tasks=[str(mine)], limit=3), tmp_path / "out", data)
    assert result.name == "swap_norm" and "swap_norm_acc_norm" in result.metrics
    assert METRICS["swap_norm_acc_norm"].higher_is_better
    assert {r["swap_norm_acc_norm"] for r in result.records} <= {0.0, 1.0}


def test_unknown_task_names_the_available_ones(engine, data, tmp_path):
    tasks = prepare_tasks(["word_swap"], tmp_path / "w", data)
    with pytest.raises(BadInput, match="not found") as e:
        run_lmeval(engine, ["wordswap"], tasks.include_paths, 2, tmp_path / "o")
    assert "word_swap" in " ".join(e.value.problems)
