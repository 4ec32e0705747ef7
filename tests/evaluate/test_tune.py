"""Engine tuning: the search space is checked against each backend's config, the Pareto front and
the winner follow their definitions, and a real tuning run on the tiny model serves every trial
over HTTP, logs every trial to MLflow, builds both roles with the winner and is not re-run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from rich.console import Console

from kiln.evaluate.tune import TuneConfig, Trial, mark, pareto_front, settings, with_knobs
from kiln.core.errors import BadInput, KilnError
from kiln.pipeline.recipe.schema import Recipe, load_recipe
from tests.pipeline.conftest import kiln

GATE = {"checks": [{"kind": "size", "max_ratio": 1.0}]}
# A load small enough for seconds per trial on the tiny model: 2 users, 16-token prompts, 8 tokens out.
LOAD = {"shape": {"kind": "concurrent", "concurrency": 2}, "duration_s": 3, "warmup": {"seconds": 0.5},
        "cooldown": {"seconds": 0.5}, "output_tokens": 8, "workload": {"input_tokens": {"mean": 16}}}


def _recipe(tmp_path: Path, engine: dict, **extra) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "optimize": {"method": "none"}, "engine": engine, "gate": GATE, **extra}))
    return path


@pytest.mark.parametrize(("engine", "expected"), [
    ({"backend": "torch", "tune": {"space": {"thread": [1, 2]}}},
     ["tune.space.thread: not a knob of the torch backend", "Did you mean 'threads'?",
      "max_batch_size", "score_batch_tokens"]),
    # a knob of another backend is not one of this backend's
    ({"backend": "torch", "tune": {"space": {"kv_cache_precision": ["u8"]}}},
     ["tune.space.kv_cache_precision: not a knob of the torch backend"]),
    ({"backend": "torch", "tune": {"space": {"threads": [2, 0]}}},
     ["tune.space.threads: 0 is not a valid value", "greater than or equal to 1"]),
    ({"backend": "openvino", "tune": {"space": {"weights": ["int8", "int3"]}}},
     ["tune.space.weights: 'int3' is not a valid value", "'int4'"]),
    ({"backend": "torch", "tune": {"space": {"threads": []}}}, ["tune.space", "at least one value"]),
    ({"backend": "torch", "tune": {"space": {"backend": ["openvino"]}}}, ["tune.space.backend: not a knob"]),
])
def test_bad_search_space_names_the_knob_and_the_fix(tmp_path, engine, expected):
    with pytest.raises(BadInput) as e:
        load_recipe(_recipe(tmp_path, engine))
    for text in expected:
        assert text in str(e.value), str(e.value)


def test_space_over_another_backends_knobs_validates():
    r = Recipe.model_validate({"name": "t", "optimize": {"method": "none"}, "gate": GATE, "engine": {
        "backend": "openvino", "tune": {"space": {"weights": ["int8", "int4"], "kv_cache_precision": ["f32", "u8"]}}}})
    assert r.tune.space["kv_cache_precision"] == ["f32", "u8"]


def test_grid_or_seeded_subset_in_grid_order():
    space = {"threads": [1, 2], "max_batch_size": [1, 4, 8]}
    grid = [{"threads": t, "max_batch_size": b} for t in (1, 2) for b in (1, 4, 8)]
    assert settings(TuneConfig(space=space, max_trials=6)) == grid
    subset = settings(TuneConfig(space=space, max_trials=4, seed=3))
    assert len(subset) == 4 and all(s in grid for s in subset)
    assert [grid.index(s) for s in subset] == sorted(grid.index(s) for s in subset)
    assert settings(TuneConfig(space=space, max_trials=4, seed=3)) == subset


def test_engine_tune_reads_as_tune_and_trials_hash_like_hand_written_configs():
    from kiln.engine.cache import engine_key
    from kiln.engine.hf_torch import TorchEngineConfig

    r = Recipe.model_validate({"name": "t", "optimize": {"method": "none"}, "gate": GATE, "engine": {
        "backend": "torch", "dtype": "float32", "tune": {"space": {"max_batch_size": [1, 4]}}}})
    assert r.tune.space == {"max_batch_size": [1, 4]} and r.engine == TorchEngineConfig(dtype="float32")
    assert "tune" not in r.engine.model_dump(mode="json")  # the engine's cache key is an untuned config's
    trial = with_knobs(r.engine, {"max_batch_size": 4})
    assert trial == TorchEngineConfig(dtype="float32", max_batch_size=4)
    assert engine_key(trial, "sha", {}, None) == engine_key(TorchEngineConfig(max_batch_size=4), "sha", {}, None)


def test_pareto_front_on_synthetic_points():
    # (output tok/s, TPOT p95 ms): higher throughput and lower latency are better
    points = [(100, 50), (80, 30), (90, 60), (100, 50), (60, 30), (120, 90), (math.nan, 10), (70, 20)]
    assert pareto_front(points) == [True, True, False, True, False, True, False, True]
    assert pareto_front([]) == []


def _trial(goodput: float, tok_s: float, tpot: float, error: str | None = None) -> Trial:
    return Trial({"goodput": goodput}, metrics={"goodput": goodput, "output_token_throughput": tok_s,
                                                "tpot_p95_ms": tpot}, error=error)


def test_winner_is_most_goodput_then_throughput():
    trials = [_trial(2.0, 90, 40), _trial(3.0, 80, 50), _trial(3.0, 85, 60), _trial(0.0, 200, 300),
              _trial(9.0, 0, 0, error="RuntimeError: out of memory")]
    winner = mark(trials)
    assert winner is trials[2] and [t.winner for t in trials] == [False, False, True, False, False]
    # the failed trial is on no front; the 200 tok/s one is (nothing beats its throughput); the
    # winner need not be: (90, 40) beats it on both axes, but goodput also counts TTFT
    assert [t.pareto for t in trials] == [True, False, False, True, False]
    with pytest.raises(KilnError, match="every trial failed"):
        mark([_trial(0, 0, 0, error="boom")])


def test_a_setting_that_cannot_be_built_is_a_failed_trial(tmp_path):
    from kiln.engine.hf_torch import TorchEngineConfig
    from kiln.evaluate.perf.config import PerformanceConfig
    from kiln.evaluate.tune import run_trial

    load = PerformanceConfig.model_validate(LOAD)
    trial = run_trial(TorchEngineConfig(), load, {"max_batch_size": 2}, tmp_path, "sha", tmp_path / "cache")
    assert trial.error.startswith("BadInput: ") and "no config.json" in trial.error
    assert set(trial.metrics) == {"wall_s"} and not trial.winner


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_model_dir):
    """A real tuning run inside the pipeline: 3 trials on the tiny model, each served over HTTP."""
    from kiln.pipeline.stages import optimize as stage_impl
    from kiln.pipeline.recipe.model_source import resolve_model

    work = tmp_path_factory.mktemp("tune")
    recipe = Recipe.model_validate({
        "name": "tiny-tune", "model": {"path": str(tiny_model_dir)}, "optimize": {"method": "int8_weight_only"},
        "engine": {"backend": "torch", "threads": 1,
                   "tune": {"space": {"max_batch_size": [1, 2, 4]}, "load": LOAD}},
        "gate": GATE, "tracking": {"uri": f"sqlite:///{work / 'mlflow.db'}", "experiment": "tune-test"}})
    ctx = _context(recipe, work, "first")
    arts = stage_impl.optimize_both(ctx, resolve_model(str(tiny_model_dir), ctx.cache))
    engines = {role: stage_impl.engine(ctx, role, art) for role, art in arts.items()}
    return {"work": work, "recipe": recipe, "ctx": ctx, "arts": arts, "engines": engines,
            "client": MlflowClient(tracking_uri=recipe.tracking.uri)}


def _context(recipe: Recipe, work: Path, name: str):
    from kiln.pipeline.stages.base import RunContext
    from kiln.pipeline.tracking.runs import Tracker

    tracker = Tracker(recipe.tracking.uri, recipe.tracking.experiment)
    run_dir = work / "runs" / name
    (run_dir / "stages").mkdir(parents=True)
    return RunContext(recipe=recipe, recipe_path=work / "r.yaml", run_dir=run_dir, cache=work / "cache",
                      tracker=tracker, parent_run=tracker.start(name, {}), console=Console(quiet=True))


def test_tuning_serves_every_trial_and_picks_the_winner_by_goodput(tuned):
    result = tuned["ctx"].outcomes["tune:candidate"].result
    trials = result["trials"]
    assert [t["knobs"] for t in trials] == [{"max_batch_size": b} for b in (1, 2, 4)]
    assert all(t["error"] is None and t["metrics"]["completed"] > 0 for t in trials), trials
    best = max(trials, key=lambda t: (t["metrics"]["goodput"], t["metrics"]["output_token_throughput"]))
    assert result["winner"] == best["knobs"] and [t["winner"] for t in trials].count(True) == 1 and best["winner"]
    front = pareto_front([(t["metrics"]["output_token_throughput"], t["metrics"]["tpot_p95_ms"]) for t in trials])
    assert [t["pareto"] for t in trials] == front
    assert result["metrics"]["tune.goodput"] == best["metrics"]["goodput"]
    assert (tuned["ctx"].outcomes["tune:candidate"].path / "pareto.png").stat().st_size > 1000


def test_both_roles_are_built_with_the_winner(tuned):
    from kiln.engine.loader import read_manifest

    winner = tuned["ctx"].outcomes["tune:candidate"].result["winner"]
    for role, engine_dir in tuned["engines"].items():
        config = read_manifest(engine_dir)["config"]
        assert "tune" not in config and config["threads"] == 1
        assert {k: config[k] for k in winner} == winner, role
    # the candidate's engine is the one its winning trial built
    trial = next(t for t in tuned["ctx"].outcomes["tune:candidate"].result["trials"] if t["winner"])
    assert tuned["engines"]["candidate"].name == trial["engine"]
    assert len(list(tuned["ctx"].run_dir.glob("stages/tune-*.json"))) == 1  # tuned once for both roles


def test_every_trial_is_a_child_run_in_mlflow(tuned):
    client, outcome = tuned["client"], tuned["ctx"].outcomes["tune:candidate"]
    exp = client.get_experiment_by_name("tune-test")
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{outcome.mlflow_run}'")
    assert len(children) == 3
    by_batch = {r.data.params["max_batch_size"]: r for r in children}
    assert set(by_batch) == {"1", "2", "4"}
    for t in outcome.result["trials"]:
        run = by_batch[str(t["knobs"]["max_batch_size"])]
        assert run.info.status == "FINISHED" and run.data.metrics["goodput"] == pytest.approx(t["metrics"]["goodput"])
        assert run.data.tags["pareto"] == str(t["pareto"]).lower() and run.data.tags["winner"] == str(t["winner"]).lower()
        assert {"output_token_throughput", "ttft_p95_ms", "tpot_p95_ms"} <= set(run.data.metrics)
    stage_run = client.get_run(outcome.mlflow_run)
    assert stage_run.data.tags["mlflow.parentRunId"] == tuned["ctx"].parent_run
    assert {"stage/pareto.png", "stage/trials.md"} <= {a.path for a in client.list_artifacts(outcome.mlflow_run, "stage")}


def test_rerun_reuses_the_tuning(tuned):
    from kiln.pipeline.stages import optimize as stage_impl

    ctx = _context(tuned["recipe"], tuned["work"], "second")
    before = sorted(p.name for p in (tuned["work"] / "cache" / "engines").iterdir())
    for role in ("baseline", "candidate"):  # optimize outcomes, as optimize_both leaves them
        ctx.outcomes[f"optimize:{role}"] = tuned["ctx"].outcomes[f"optimize:{role}"]
    engines = {role: stage_impl.engine(ctx, role, art) for role, art in tuned["arts"].items()}
    outcome = ctx.outcomes["tune:candidate"]
    assert outcome.reused and outcome.result == tuned["ctx"].outcomes["tune:candidate"].result
    assert engines == tuned["engines"]
    assert sorted(p.name for p in (tuned["work"] / "cache" / "engines").iterdir()) == before


def test_cli_prints_the_trials_table_from_the_cached_search(tuned):
    recipe = tuned["work"] / "tiny-tune.yaml"
    recipe.write_text(yaml.safe_dump(tuned["recipe"].model_dump(mode="json")))
    from kiln.core.signing import SIGNING_KEY_ENV, machine_key_path

    # The fixture's stages were sealed in this process, with the key of this session's cache: the CLI, on
    # another cache, trusts what it finds there only under the same key (a cache's key is its machine's).
    env = {"KILN_CACHE": str(tuned["work"] / "cache"), SIGNING_KEY_ENV: str(machine_key_path())}
    proc = kiln("tune", str(recipe), cwd=tuned["work"], env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "unchanged inputs, reusing" in proc.stdout  # the search is not run again
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 3 and sum("★" in r for r in rows) == 1 and any("✓" in r for r in rows)
    winner = tuned["ctx"].outcomes["tune:candidate"].result["winner"]
    assert f"winner: {winner}" in proc.stdout
    state = json.loads(next((tuned["work"] / "runs").glob("tiny-tune-*/state.json")).read_text())
    assert state["status"] == "finished"


def test_cli_refuses_a_recipe_without_a_search(tmp_path):
    proc = kiln("tune", str(_recipe(tmp_path, {"backend": "torch"})), cwd=tmp_path)
    assert proc.returncode == 2 and "tune is not set" in proc.stderr
