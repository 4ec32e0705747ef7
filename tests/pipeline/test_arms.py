"""A recipe's two arms may be served differently: `baseline.engine` puts the unchanged checkpoint
on its own backend (what a naive deployment serves) while the candidate runs the tuned engine, and
every quality check and the benchmark compare across the two backends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.pipeline.recipe.schema import Recipe
from tests.pipeline.conftest import TINY_RECIPE, kiln, write_recipe


def _result(run_dir: Path, stage: str) -> dict:
    path = Path(json.loads((run_dir / "stages" / f"{stage}.json").read_text())["path"])
    return json.loads((path / "result.json").read_text())


def test_baseline_on_torch_and_candidate_on_ctranslate2(tmp_path, tiny_model_dir):
    recipe = write_recipe(
        tmp_path / "arms.yaml", tiny_model_dir, name="tiny-arms", optimize={"method": "none"},
        engine={"backend": "ctranslate2", "quantization": "int8_float32", "threads": 2},
        baseline={"engine": {"backend": "torch", "threads": 2}}, evaluate__quality__lmeval=None,
        evaluate__quality__served={"num_prompts": 6, "max_new_tokens": 6, "concurrency": 3},
        gate__checks=[{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
                      {"kind": "agreement", "metric": "top1_agreement", "min": 0.5},
                      {"kind": "agreement", "metric": "served_prefix", "min": 0.3}])
    proc = kiln("run", str(recipe), cwd=tmp_path)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next((tmp_path / "runs").iterdir())
    backends = {role: json.loads((Path(_result(run_dir, f"engine-{role}")["engine_dir"]) / "kiln-engine.json")
                                 .read_text())["backend"] for role in ("baseline", "candidate")}
    assert backends == {"baseline": "torch", "candidate": "ctranslate2"}
    verdict = json.loads((run_dir / "verdict.json").read_text())
    checks = {c["name"]: c for c in verdict["checks"]}
    assert set(checks) == {"quality:perplexity", "agreement:top1_agreement", "agreement:served_prefix"}
    assert all(c["verdict"] != "Error" for c in checks.values()), checks
    agreement = _result(run_dir, "agreement-candidate")["metrics"]
    assert 0.5 <= agreement["top1_agreement"] <= 1.0  # int8 weights on another backend: close, not identical
    assert _result(run_dir, "benchmark-pair")["metrics"]  # the speed benchmark ran on both backends
    # Memory and cost: CTranslate2 serves its own int8 conversion, not the fp32 artifact it was built from.
    from kiln.core.files import dir_size

    ct2 = dir_size(Path(_result(run_dir, "engine-candidate")["engine_dir"]))
    artifact = _result(run_dir, "optimize-candidate")["metrics"]["size_bytes"]
    assert ct2 < artifact  # int8 weights (its folder), not the fp32 artifact the size check reads
    row = next(line for line in (run_dir / "report.md").read_text().splitlines() if line.startswith("| size served from"))
    assert f"| {artifact / 1e6:,.1f} MB | {ct2 / 1e6:,.1f} MB |" in row, row


@pytest.mark.parametrize(("baseline", "needle"), [
    ({"engine": {"backend": "torch", "tune": {"space": {"max_batch_size": [1, 4]}}}}, "baseline.engine.tune"),
    ({"engine": {"backend": "no-such"}}, "baseline.engine"),
    ({"optimize": {"method": "none"}}, "baseline.optimize"),
])
def test_a_bad_baseline_section_names_its_field(baseline, needle):
    from pydantic import ValidationError

    raw = {**TINY_RECIPE, "model": {"path": "demo"}, "baseline": baseline}
    with pytest.raises(ValidationError, match=needle.replace(".", r"\.")):
        Recipe.model_validate(raw)


def test_without_a_baseline_section_both_arms_share_the_engine():
    r = Recipe.model_validate({**TINY_RECIPE, "model": {"path": "demo"}})
    assert r.engine_for("baseline") is r.engine_for("candidate") is r.engine
