"""A finished stage is reused only while what it points at still exists.

The engine stage's result names an engine folder outside the stage (<cache>/engines/<key>). When that
folder is deleted by hand (or by a tool that is not `kiln cache prune`), reusing the stage record would
send every later stage to a missing engine; the stage is computed again instead, and says why.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from kiln.pipeline.stages.base import RunContext, run_stage
from tests.pipeline.conftest import fresh_cache, kiln, quick_recipe


def _ctx(tmp_path: Path, console: Console) -> RunContext:
    tracker = SimpleNamespace(start=lambda *a, **k: "run", log=lambda *a, **k: None, end=lambda *a, **k: None,
                              log_artifacts=lambda *a, **k: None, find_stage=lambda key: None)
    recipe = SimpleNamespace(name="r", digest=lambda: "d")
    return RunContext(recipe, tmp_path / "r.yaml", tmp_path / "run", tmp_path / "cache", tracker, "parent", console)


def test_a_stage_whose_output_elsewhere_is_gone_is_computed_again(tmp_path):
    outside = tmp_path / "built"
    calls = []

    def compute(out: Path) -> dict:
        calls.append(out)
        outside.mkdir(exist_ok=True)
        (outside / "made").write_text("x")
        return {"where": str(outside), "metrics": {}}

    def needs(result: dict) -> list[Path]:
        return [Path(result["where"]) / "made"]

    console = Console(record=True, width=200)
    first = run_stage(_ctx(tmp_path, console), "engine", "candidate", {"x": 1}, compute, needs=needs)
    again = run_stage(_ctx(tmp_path, console), "engine", "candidate", {"x": 1}, compute, needs=needs)
    assert not first.reused and again.reused and len(calls) == 1
    shutil.rmtree(outside)
    rebuilt = run_stage(_ctx(tmp_path, console), "engine", "candidate", {"x": 1}, compute, needs=needs)
    assert not rebuilt.reused and len(calls) == 2 and (outside / "made").exists()
    assert f"{outside / 'made'} is gone; computing the stage again" in console.export_text()


def test_a_run_whose_engine_folder_was_deleted_builds_it_again(tmp_path, tiny_model_dir):
    """The real CLI: the failure a CI machine met when its cache's engines were deleted by hand."""
    env = {"KILN_CACHE": str(fresh_cache(tmp_path / "cache"))}
    recipe = quick_recipe(tmp_path / "r.yaml", tiny_model_dir, name="rebuild")
    first = kiln("run", str(recipe), cwd=tmp_path, env=env)
    assert first.returncode in (0, 1, 3), first.stdout[-3000:] + first.stderr[-3000:]
    engines = sorted((tmp_path / "cache" / "engines").iterdir())
    assert engines
    for e in engines:
        shutil.rmtree(e)
    second = kiln("run", str(recipe), cwd=tmp_path, env=env)
    assert second.returncode == first.returncode, second.stdout[-3000:] + second.stderr[-3000:]
    assert "is gone; computing the stage again" in " ".join(second.stdout.split())  # rich wraps at 80 columns
    newest = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    stages = {p.stem: json.loads(p.read_text()) for p in (newest / "stages").glob("*.json")}
    assert not stages["engine-candidate"]["reused"] and stages["optimize-candidate"]["reused"]
    assert all((e / "kiln-engine.json").is_file() for e in engines)


def test_fresh_computes_a_stage_once_per_run_and_its_arms_share_it(tmp_path):
    """`kiln run --fresh all` on a search: every arm asks for the baseline's quality stage (one key);
    the run computes it once, even where a finished copy from an earlier run exists, and each arm's
    context (a copy of the run's) reuses that. A second run with `--fresh` computes it once again."""
    from dataclasses import replace

    calls = []

    def compute(out: Path) -> dict:
        calls.append(out)
        return {"metrics": {}}

    console = Console(record=True, width=200)
    run_stage(_ctx(tmp_path, console), "quality", "baseline", {"x": 1}, compute)  # an earlier run's copy
    for _ in range(2):
        run = replace(_ctx(tmp_path, console), fresh={"all"})
        arms = [replace(run, arm=name, outcomes={}) for name in ("q8_0", "q4_K_M", "openvino")]
        outcomes = [run_stage(arm, "quality", "baseline", {"x": 1}, compute) for arm in arms]
        assert [o.reused for o in outcomes] == [False, True, True]
        assert run_stage(arms[0], "quality", "candidate", {"x": 2}, compute).reused is False
    assert len(calls) == 1 + 2 * 2
