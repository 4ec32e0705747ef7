"""`kiln run` on a search whose one candidate is GGUF q8_0 served by llama.cpp (each runtime in
turn), against the torch fp32 baseline, on the tiny Llama: perplexity, token agreement and an
lm-eval task are computed through the llama_cpp engine (in-process scoring) and gated, and the
search records the candidate as any other (search.json, the report's candidates table, an MLflow
child run).

One candidate keeps this as cheap as the single-candidate run it replaces: the family's
confidence is the gate's own (95%) and a lone winner gets no confirmation benchmark. Measured
before the search form: top-1 agreement 0.997, word_swap 0.475 = baseline, perplexity within
0.01% (Inconclusive then: 12 documents, fewer than the 24 a pass needs at 95%).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.llama_cpp_build import require_llama_cpp
from tests.pipeline.conftest import TINY_RECIPE, kiln

NAME = "llama-q8_0"
CANDIDATE = {"name": NAME, "optimize": {"method": "gguf", "type": "q8_0", "threads": 1},
             "engine": {"backend": "llama_cpp", "threads": 1, "parallel": 2, "ctx_per_slot": 256}}
PRICE = 2.0


@pytest.fixture(scope="module", params=["server", "library"])
def gguf_run(request, tmp_path_factory, tiny_model_dir):
    """The run, once per llama_cpp runtime (llama-server; llama.cpp in kiln's process, as the demo's)."""
    require_llama_cpp()
    work = tmp_path_factory.mktemp(f"gguf-run-{request.param}")
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    del raw["optimize"], raw["engine"]
    candidate = {**CANDIDATE, "engine": {**CANDIDATE["engine"], "runtime": request.param}}
    raw.update(name="tiny-gguf", model={"path": str(tiny_model_dir)}, candidates=[candidate],
               baseline={"engine": {"backend": "torch", "threads": 1}}, search={"price_per_hour": PRICE})
    raw["evaluate"]["quality"]["perplexity"]["max_documents"] = 24  # fewer cannot pass (bench/ppl_calibration.py)
    recipe = work / "tiny-gguf.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"work": work, "proc": proc, "run_dir": next((work / "runs").iterdir()), "runtime": request.param}


def _engine_manifest(stages: Path, role: str) -> dict:
    stage = Path(json.loads((stages / f"engine-{role}.json").read_text())["path"])
    engine_dir = Path(json.loads((stage / "result.json").read_text())["engine_dir"])
    return json.loads((engine_dir / "kiln-engine.json").read_text())


def test_every_quality_check_is_gated_through_llama_cpp(gguf_run):
    run_dir = gguf_run["run_dir"]
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["exit_code"] == gguf_run["proc"].returncode == 0
    checks = {c["metric"]: c for c in verdict["checks"]}
    for metric in ("perplexity", "top1_agreement", "word_swap_acc", "size_bytes"):
        assert checks[metric]["verdict"] == "Successful", checks[metric]
    # The run's stages/ is the winner's: the GGUF on llama.cpp, judged against torch.
    for stages in (run_dir / "stages", run_dir / "candidates" / NAME / "stages"):
        engine = _engine_manifest(stages, "candidate")
        assert engine["backend"] == "llama_cpp" and engine["build"]["type"] == "q8_0", stages
        assert engine["config"]["runtime"] == gguf_run["runtime"], stages
        assert _engine_manifest(stages, "baseline")["backend"] == "torch", stages
    # q8_0 of a random tiny model stays near fp32 (sanity bounds; the gate judges the rest)
    ppl = checks["perplexity"]
    assert abs(ppl["observed"] / ppl["baseline"] - 1) < 0.05, ppl
    assert checks["top1_agreement"]["observed"] > 0.9, checks["top1_agreement"]


def test_the_llama_cpp_candidate_is_a_search_candidate_like_any_other(gguf_run):
    import mlflow

    run_dir = gguf_run["run_dir"]
    record = json.loads((run_dir / "search.json").read_text())
    assert record["winner"] == NAME and record["confidence"] == pytest.approx(0.95)
    [row] = record["candidates"]
    assert (row["name"], row["engine"], row["optimize"]) == (NAME, "llama_cpp q8_0", "gguf"), row
    assert row["eliminated"] is None and row["reached"] == "rest" and row["verdict"] == "Successful", row
    assert row["screened"]["pairs"] >= 2 and row["confirmed"] is None  # a lone candidate is not re-measured
    bench = json.loads((run_dir / "stages" / "benchmark-pair.json").read_text())
    tok_s = json.loads((Path(bench["path"]) / "result.json").read_text())["metrics"]["candidate.decode_tok_s"]
    assert row["decode_tok_s"] == pytest.approx(tok_s) and tok_s > 0
    assert row["cost_per_1m"] == pytest.approx(PRICE / (tok_s * 3600) * 1e6)
    assert abs(row["perplexity"]["change"]) < 0.05, row
    size = next(c for c in json.loads((run_dir / "verdict.json").read_text())["checks"] if c["kind"] == "size")
    assert 0 < row["serving_bytes"] < size["baseline"], (row, size)  # the GGUF folder, smaller than fp32
    assert record["baseline"]["engine"] == "torch float32" and record["baseline"]["decode_tok_s"] > 0
    report = (run_dir / "report.md").read_text()
    assert "## Candidates" in report and f"🏆 {NAME}" in report

    client = mlflow.MlflowClient(f"sqlite:///{gguf_run['work'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln-test")
    [child] = client.search_runs([exp.experiment_id], "tags.`kiln.stage` = 'candidate'")
    assert (child.data.tags["kiln.candidate"], child.data.tags["kiln.search"]) == (NAME, "winner")
    assert client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{child.info.run_id}'")
