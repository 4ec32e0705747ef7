"""`kiln run` with the served-text check on, and the parity smoke check every engine build gets."""

import io
import json
from pathlib import Path

import pytest

from kiln.core.errors import BadInput
from kiln.pipeline.stages.inputs import read_prompts
from tests.pipeline.conftest import kiln, write_recipe


def _result(run_dir: Path, stage: str) -> tuple[dict, Path]:
    path = Path(json.loads((run_dir / "stages" / f"{stage}.json").read_text())["path"])
    return json.loads((path / "result.json").read_text()), path


def test_every_engine_build_records_its_parity_figures(tiny_run):
    base, _ = _result(tiny_run["run_dir"], "engine-baseline")
    assert base["parity"]["exact_required"] and base["parity"]["defects"] == 0  # fp32 on torch: exact
    assert base["metrics"]["parity_identical"] == base["parity"]["identical"]
    cand, cand_dir = _result(tiny_run["run_dir"], "engine-candidate")
    assert not cand["parity"]["exact_required"]  # int8 weights: figures recorded, never refused here
    assert 0 <= cand["parity"]["max_abs_logprob"] < 10
    per_prompt = json.loads((cand_dir / "parity.json").read_text())["per_prompt"]
    assert len(per_prompt) == 5 and all(len(r["reference"]) == 8 for r in per_prompt)
    assert [r["prompt_tokens"] for r in per_prompt][3:] == [1, 1]  # a one-token prompt and "a" (issue 39)


def test_served_text_check_gates_a_run(tmp_path, tiny_model_dir):
    # The baseline as its own candidate: its server under load must write what it writes alone.
    recipe = write_recipe(
        tmp_path / "served.yaml", tiny_model_dir, name="tiny-served", optimize={"method": "none"},
        evaluate__quality__agreement=False, evaluate__quality__lmeval=None,
        evaluate__quality__served={"num_prompts": 6, "max_new_tokens": 6, "concurrency": 3},
        gate__checks=[{"kind": "agreement", "metric": "served_prefix", "min": 0.9}])
    proc = kiln("run", str(recipe), cwd=tmp_path)
    run_dir = next((tmp_path / "runs").iterdir())
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [(c["name"], c["verdict"]) for c in verdict["checks"]] == [("agreement:served_prefix", "Successful")]
    served, path = _result(run_dir, "served-candidate")
    assert served["metrics"]["served_match"] == 1.0
    records = [json.loads(line) for line in (path / "served.jsonl").read_text().splitlines()]
    assert len(records) == 6 + 2 and len({r["prompt_tokens"] for r in records}) > 1  # + a one-token prompt and "a"
    assert all(r["baseline"] == r["candidate"] and len(r["candidate"]) == 6 for r in records)
    assert "baseline_text" in records[0] and "candidate_text" in records[0]


def test_too_few_prompts_for_the_served_check_names_its_field(demo_data):
    with pytest.raises(BadInput, match=r"evaluate\.quality\.served\.num_prompts asks for 1000000"):
        read_prompts("demo", 10**6, "evaluate.quality.served.num_prompts")


def test_a_recipe_whose_candidate_decodes_wrongly_when_batched_fails_the_run(tmp_path, tiny_model_dir, monkeypatch):
    """The CTranslate2 cohort defect, kept reachable: the candidate's engine (int8 weight-only on
    torch) is exact alone and off by one token whenever two requests share a step. Token agreement
    scores one request at a time and cannot see it; the served text under load must."""
    from rich.console import Console

    from kiln.engine import loader
    from kiln.pipeline.recipe.schema import load_recipe
    from kiln.pipeline.runner import run_pipeline
    from tests.evaluate.broken_engine import BatchBrokenEngine
    from tests.pipeline.conftest import fresh_cache

    real, loaded = loader.load_engine, []

    def load(engine_dir, **options):
        manifest = loader.read_manifest(engine_dir)
        checkpoint = Path(manifest["build"]["checkpoint"])
        artifact = json.loads((checkpoint / "kiln-artifact.json").read_text())
        if manifest["backend"] != "torch" or artifact["method"] == "none":  # the baseline serves soundly
            return real(engine_dir, **options)
        engine = BatchBrokenEngine(checkpoint, loader.engine_config(manifest))
        engine.manifest = manifest
        loaded.append(engine)
        return engine

    monkeypatch.setattr(loader, "load_engine", load)
    monkeypatch.setenv("KILN_CACHE", str(fresh_cache(tmp_path / "cache")))  # nothing reused from a sound engine
    recipe = write_recipe(
        tmp_path / "broken.yaml", tiny_model_dir, name="tiny-batch-broken", evaluate__quality__lmeval=None,
        evaluate__quality__served={"num_prompts": 6, "max_new_tokens": 6, "concurrency": 3},
        evaluate__quality__perplexity__max_documents=6, tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        gate__checks=[{"kind": "agreement", "metric": "top1_agreement", "min": 0.5},
                      {"kind": "agreement", "metric": "served_prefix", "min": 0.3}])
    outcome, _ = run_pipeline(load_recipe(recipe), recipe, tmp_path / "runs", Console(file=io.StringIO()))
    checks = {r.name: r.verdict.value for r in outcome.results}
    assert checks == {"agreement:top1_agreement": "Successful", "agreement:served_prefix": "Failed"}, outcome.to_dict()
    assert outcome.verdict.value == "Failed" and int(outcome.exit_code) == 1
    assert any(e.crowded_steps for e in loaded)  # the broken engine served, and was batched


def test_a_gguf_build_is_checked_against_the_runs_own_copy_of_its_source(tmp_path):
    # A reused gguf optimize stage records the folder it was made from; a deterministic tiny model
    # gives the same stage key from another temporary folder, deleted since. The run's baseline
    # artifact (same source hash) is the reference's checkpoint, the recorded folder only after it.
    from types import SimpleNamespace

    from kiln.optimize.base import ModelArtifact
    from kiln.pipeline.stages.optimize import _unquantized_sources

    baseline = SimpleNamespace(path=tmp_path / "optimize-baseline", result={"manifest": {"source_sha256": "abc"}})
    art = ModelArtifact(path=tmp_path / "gguf", manifest={"source": "/tmp/gone", "source_sha256": "abc"})
    ctx = SimpleNamespace(outcomes={"optimize:baseline": baseline})
    assert _unquantized_sources(ctx, art) == [tmp_path / "optimize-baseline" / "model", "/tmp/gone"]
    other = ModelArtifact(path=tmp_path / "gguf", manifest={"source": "/src", "source_sha256": "def"})
    assert _unquantized_sources(ctx, other) == ["/src"]  # another model's baseline is no reference
    assert _unquantized_sources(SimpleNamespace(outcomes={}), art) == ["/tmp/gone"]
