"""The search's plan: which stages each candidate runs or reuses, and the time this machine measured
for them on the recipe's earlier runs (unknown where it never ran one)."""

from __future__ import annotations

from types import SimpleNamespace as NS

from kiln.pipeline.recipe.schema import QualitySection
from kiln.pipeline.search import plan as search_plan


def _recipe(digest: str, agreement: bool = True) -> NS:
    quality = QualitySection(agreement=agreement)  # perplexity on by default, served and lm-eval off
    return NS(evaluate=NS(quality=quality, load=None), digest=lambda: digest)


def _run(arm: str, stage: str, role: str, wall: float, digest: str = "d-a", key: str = "") -> NS:
    tags = {"kiln.candidate": arm, "kiln.stage": stage, "kiln.role": role, "kiln.recipe_hash": digest,
            **({"kiln.stage_key": key} if key else {})}
    return NS(data=NS(tags=tags, metrics={"wall_s": wall}))


def _ctx(tmp_path, fresh=()) -> NS:
    return NS(cache=tmp_path, fresh=set(fresh))


def _finished(tmp_path, stage: str, key: str) -> None:
    (tmp_path / "stages" / stage / key).mkdir(parents=True)
    (tmp_path / "stages" / stage / key / "result.json").write_text("{}")


def test_a_first_run_says_its_time_is_unknown(tmp_path):
    plans = search_plan.plan(_ctx(tmp_path), [("a", _recipe("d-a")), ("b", _recipe("d-b"))], [])
    assert [p.name for p in plans] == ["baseline", "a", "b"]
    assert [(s.stage, s.role) for s in plans[0].stages] == [("optimize", "baseline"), ("engine", "baseline"),
                                                           ("quality", "baseline")]
    assert [s.stage for s in plans[1].stages] == ["optimize", "engine", "quality", "agreement", "benchmark"]
    text = search_plan.lines(plans, None)
    assert text[-1] == "  13 stages to run, 0 reused; time unknown: this recipe has not run here before"


def test_finished_stages_are_reused_and_the_rest_timed_from_earlier_runs(tmp_path):
    _finished(tmp_path, "optimize", "k1")
    runs = [_run("a", "optimize", "candidate", 12.0, key="k1"),  # finished, still in the cache: reused
            _run("a", "engine", "candidate", 30.0, key="gone"),  # finished, pruned since: to run, in 30 s
            _run("a", "quality", "candidate", 50.0, digest="d-old", key="k1"),  # another configuration: timed only
            _run("b", "benchmark", "pair", 100.0), _run("b", "benchmark", "pair", 999.0)]  # newest first
    plans = search_plan.plan(_ctx(tmp_path), [("a", _recipe("d-a", agreement=False))], runs)
    a = {s.stage: s for s in plans[1].stages}
    assert a["optimize"].reused and not a["engine"].reused and not a["quality"].reused
    assert (a["engine"].seconds, a["quality"].seconds, a["benchmark"].seconds) == (30.0, 50.0, 100.0)
    text = search_plan.lines(plans, search_plan.Planned("benchmark", "pair", seconds=100.0))
    assert text[1] == ("  a: to run: engine[candidate] (~30s), quality[candidate] (~50s), benchmark[pair] (~1m40s); "
                       "reused from the cache: optimize[candidate]")
    assert text[2] == "  then the winner's confirmation benchmark (~1m40s)"
    assert text[-1] == ("  7 stages to run, 1 reused; about 4m40s plus 3 stages never timed here "
                        "if every candidate reaches every stage")
    fresh = search_plan.plan(_ctx(tmp_path, fresh={"optimize"}), [("a", _recipe("d-a"))], runs)
    assert not fresh[1].stages[0].reused  # --fresh optimize: computed again


def test_the_plan_lists_a_registered_evals_stage_in_its_phase(monkeypatch):
    """The plan's stages are the evaluate stage's: a new eval's stage appears where it runs, once per arm."""
    from pydantic import Field

    from kiln.evaluate.quality.base import QUALITY_EVALS, QualityEval

    toy = type("Toy", (QualityEval,), {"section": Field(None), "stage": "toy", "phase": "agreement"})
    monkeypatch.setitem(QUALITY_EVALS._plugins, "toy", toy)
    recipe = _recipe("d-a")
    quality = NS(**{name: getattr(recipe.evaluate.quality, name) for name in QUALITY_EVALS.names() if name != "toy"},
                 toy={"documents": 2})
    stages = search_plan.stages_of(NS(evaluate=NS(quality=quality, load=None)))
    assert stages[stages.index(("agreement", "candidate")) + 1:][:3] == [("toy", "baseline"), ("toy", "candidate"),
                                                                         ("benchmark", "pair")], stages
