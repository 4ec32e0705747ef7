"""A stage holds the engines it measures and no other (issue 35): an arm's perplexity runs with that
arm's engine alone, the baseline released first even where a search shares it between arms, and the
benchmark, which sets the two side by side, loads the baseline again; the served text's server loads
the candidate once more, with the run's own copy closed."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from kiln.engine.hf_torch import TorchEngine
from kiln.pipeline.search import search
from kiln.pipeline.stages import evaluate as stage_evaluate
from kiln.pipeline.recipe.schema import Recipe
from kiln.pipeline.stages.inputs import LazyEngines


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_model_dir):
    """The tiny checkpoint as a baseline (torch float32) and a candidate (torch bfloat16), built."""
    from kiln.pipeline.stages import optimize as stage_optimize
    from kiln.pipeline.recipe.model_source import resolve_model
    from kiln.pipeline.stages.base import RunContext
    from kiln.pipeline.tracking.runs import Tracker

    work = tmp_path_factory.mktemp("arms")
    recipe = Recipe.model_validate({
        "name": "arms", "model": {"path": str(tiny_model_dir)}, "optimize": {"method": "none"},
        "engine": {"backend": "torch", "dtype": "bfloat16", "threads": 1},
        "baseline": {"engine": {"backend": "torch", "dtype": "float32", "threads": 1}},
        "evaluate": {"quality": {"perplexity": {"text": "demo", "max_documents": 4, "seq_len": 64},
                                 "agreement": False, "lmeval": None},
                     "benchmark": {"prompts": "demo", "num_prompts": 2, "max_new_tokens": 4, "repeats": 2}},
        "gate": {"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}]},
        "tracking": {"uri": f"sqlite:///{work / 'mlflow.db'}", "experiment": "arms"}})
    tracker = Tracker(recipe.tracking.uri, recipe.tracking.experiment)
    run_dir = work / "run"
    (run_dir / "stages").mkdir(parents=True)
    ctx = RunContext(recipe=recipe, recipe_path=work / "r.yaml", run_dir=run_dir, cache=work / "cache",
                     tracker=tracker, parent_run=tracker.start("arms", {}), console=Console(quiet=True))
    arts = stage_optimize.optimize_both(ctx, resolve_model(str(tiny_model_dir), ctx.cache))
    return ctx, {role: stage_optimize.engine(ctx, role, art) for role, art in arts.items()}


@pytest.fixture
def live(monkeypatch):
    """Torch engines alive now (by dtype), and what was alive each time an arm was scored or benchmarked."""
    seen = {"now": [], "scored": [], "benchmarked": []}
    init, close = TorchEngine.__init__, TorchEngine.close

    def counted_init(self, checkpoint, config):
        init(self, checkpoint, config)
        seen["now"].append(config.dtype)

    def counted_close(self):
        close(self)
        seen["now"].remove(self.config.dtype)

    import kiln.evaluate.quality.perplexity as ppl
    import kiln.pipeline.stages.benchmark as bench

    scorer, decoder = ppl.perplexity, bench._decode_bench

    def scored(engine, docs):
        seen["scored"].append(sorted(seen["now"]))
        return scorer(engine, docs)

    def benchmarked(ctx, engines, *args):
        seen["benchmarked"].append(sorted(seen["now"]))
        return decoder(ctx, engines, *args)

    monkeypatch.setattr(TorchEngine, "__init__", counted_init)
    monkeypatch.setattr(TorchEngine, "close", counted_close)
    monkeypatch.setattr(ppl, "perplexity", scored)
    monkeypatch.setattr(bench, "_decode_bench", benchmarked)
    return seen


def test_each_arm_is_scored_alone_and_benchmarked_beside_the_baseline(built, live):
    ctx, engines = built
    shared = LazyEngines({}, search._load)  # the search's baseline, shared by every arm
    arm = SimpleNamespace(engines=engines)
    try:
        with search._engines(arm, shared) as loaded:
            stage_evaluate.evaluate(ctx, engines, phases=("quality",), loaded=loaded)
        # The baseline was scored first, then released before the candidate loaded; the candidate
        # is closed when its phase ends.
        assert live["scored"] == [["float32"], ["bfloat16"]], live
        assert live["now"] == [] and "baseline" not in shared
        with search._engines(arm, shared) as loaded:
            stage_evaluate.evaluate(ctx, engines, phases=("speed",), loaded=loaded)
        assert live["benchmarked"] == [["bfloat16", "float32"]], live
        assert live["now"] == ["float32"] and "baseline" in shared  # kept for the next arm's benchmark
    finally:
        shared.close()


def test_a_cached_stage_loads_nothing(built, live):
    """A stage already computed reuses its result: no engine is loaded or released for it."""
    ctx, engines = built
    for _ in range(2):  # the first computes the stages (unless an earlier test did), the second reuses them
        live["scored"].clear()
        loaded = LazyEngines(engines, search._load)
        stage_evaluate.evaluate(ctx, engines, phases=("quality",), loaded=loaded)
    assert live["scored"] == [] and dict(loaded) == {} and live["now"] == []


def test_keep_only_closes_and_forgets_the_others(tmp_path):
    closed = []
    engines = LazyEngines({"a": tmp_path / "a", "b": tmp_path / "b"},
                          lambda d: SimpleNamespace(close=lambda: closed.append(d.name)))
    engines["a"], engines["b"]
    engines.keep_only("b")
    assert closed == ["a"] and list(engines) == ["b"]
    engines.keep_only("a")  # nothing loaded for `a`: it is not loaded here either
    assert closed == ["a", "b"] and list(engines) == []


def test_the_served_texts_server_loads_the_candidate_with_the_runs_copy_closed(built, live, monkeypatch):
    """The benchmark leaves both arms loaded; the served text then starts a `kiln serve` that loads the
    candidate's engine itself. The run's copy is closed first: two copies of the candidate's weights are
    never held (OpenVINO's repacked weights, torch's tensors: anonymous memory, not shared file pages)."""
    import kiln.evaluate.quality.served as served

    ctx, engines = built
    raw = ctx.recipe.model_dump(mode="json", exclude_unset=True)
    raw["evaluate"]["quality"]["served"] = {"num_prompts": 2, "max_new_tokens": 2, "concurrency": 2}
    ctx = dataclasses.replace(ctx, recipe=Recipe.model_validate(raw))
    under_load, at_serve = served.under_load, []

    def serving(load, *args):
        def counted():
            engine = load()
            at_serve.append(sorted(live["now"]))
            return engine
        return under_load(counted, *args)

    monkeypatch.setattr(served, "under_load", serving)
    loaded = LazyEngines(engines, search._load)
    try:
        loaded["baseline"], loaded["candidate"]  # as the benchmark leaves them
        assert sorted(live["now"]) == ["bfloat16", "float32"]
        stage_evaluate.evaluate(ctx, engines, phases=("rest",), loaded=loaded)
    finally:
        loaded.close()
    assert at_serve == [["bfloat16", "float32"]], at_serve  # the server's candidate and the reference
