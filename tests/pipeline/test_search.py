"""The search: a recipe lists several candidate serving configurations, `kiln run` judges each
against one baseline (the checkpoint on torch fp32) at the family's confidence, stops a candidate
at the first phase it fails, measures the winner's speed again and reports every candidate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from kiln.core.gate.policy import GateSection, judge
from kiln.pipeline.recipe.schema import Recipe
from kiln.pipeline.stages.phases import PHASES, family_confidence, for_family, phase_of, up_to
from tests.pipeline.conftest import TINY_RECIPE, kiln

CANDIDATES = [
    {"name": "torch-int8", "optimize": {"method": "int8_weight_only"}, "engine": {"backend": "torch", "threads": 2}},
    # On a 2-layer model the engines' speeds are close and move with the machine's load, so what
    # decides here is quality: only the unchanged weights keep top-1 agreement at 1 (int8 on torch
    # measured 0.996-0.999, on CTranslate2 0.988); the two int8 candidates stop after the agreement phase.
    {"name": "ct2-int8", "optimize": {"method": "none"},
     "engine": {"backend": "ctranslate2", "quantization": "int8_float32", "threads": 2}},
    {"name": "fp32-copy", "optimize": {"method": "none"}, "engine": {"backend": "torch", "threads": 2}},
]
CHECKS = [
    {"kind": "size", "max_ratio": 1.0},
    {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
    {"kind": "agreement", "metric": "top1_agreement", "min": 0.9999},
    # What this file tests is the phases, not the machine: a busy CI host must not turn the speed
    # check Inconclusive (measured here: CPU pressure 0.43 with torch's own 2 threads on 2 cores; and
    # fp32-copy against its identical baseline at 0.85x [0.37, 1.96] while the other test worker ran
    # llama.cpp, per-prompt rates 11-224 tok/s: Inconclusive at 0.3). 0.1 still fails a 10x slower copy.
    {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.1, "max_cpu_pressure": None},
    {"kind": "agreement", "metric": "served_prefix", "min": 0.3},
]


def _search_recipe(path: Path, model_dir: Path) -> Path:
    raw = yaml.safe_load(yaml.safe_dump(TINY_RECIPE))
    del raw["optimize"], raw["engine"]
    raw.update(name="tiny-search", model={"path": str(model_dir)}, candidates=CANDIDATES, search={"price_per_hour": 2.0},
               currency="EUR")
    raw["evaluate"]["quality"]["lmeval"] = None
    raw["evaluate"]["quality"]["served"] = {"num_prompts": 4, "max_new_tokens": 6, "concurrency": 2}
    raw["evaluate"]["quality"]["perplexity"]["max_documents"] = 24  # fewer cannot pass (bench/ppl_calibration.py)
    raw["gate"]["checks"] = CHECKS
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def search_run(tmp_path_factory, tiny_model_dir):
    work = tmp_path_factory.mktemp("search")
    recipe = _search_recipe(work / "search.yaml", tiny_model_dir)
    first = kiln("run", str(recipe), cwd=work)
    assert first.returncode in (0, 1, 3), first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = next((work / "runs").iterdir())
    return {"work": work, "recipe": recipe, "run_dir": run_dir, "proc": first}


def test_every_candidate_is_judged_and_the_best_passing_one_wins(search_run):
    run_dir = search_run["run_dir"]
    record = json.loads((run_dir / "search.json").read_text())
    rows = {c["name"]: c for c in record["candidates"]}
    assert list(rows) == [c["name"] for c in CANDIDATES]
    assert record["confidence"] == pytest.approx(family_confidence(0.95, 3))
    passing = [c for c in rows.values() if c["eliminated"] is None]
    assert [c["name"] for c in passing] == ["fp32-copy"] == [record["winner"]], rows
    # The int8 candidates pass perplexity and fail top-1 agreement: they stop after the agreement phase
    # and never spend the benchmark or the served text (successive elimination).
    for name in ("torch-int8", "ct2-int8"):
        row = rows[name]
        assert "after its agreement stages" in row["eliminated"] and row["reached"] == "agreement", row
        assert "agreement:top1_agreement" in row["eliminated"], row
        for stage in ("benchmark-pair", "served-candidate"):
            assert not (run_dir / "candidates" / name / "stages" / f"{stage}.json").exists(), (name, stage)
        assert row["perplexity"] is not None and row["screened"] is None, row
    assert rows["fp32-copy"]["perplexity"]["change"] == 0.0  # the same weights on the same engine
    assert rows["fp32-copy"]["screened"] is not None and rows["fp32-copy"]["reached"] == "rest"
    for name in rows:  # every candidate was judged against the same baseline engine
        engine = json.loads((run_dir / "candidates" / name / "stages" / "engine-baseline.json").read_text())
        assert engine["key"] == json.loads((run_dir / "stages" / "engine-baseline.json").read_text())["key"], name


def test_the_winner_is_measured_again_and_laid_out_as_the_run(search_run):
    run_dir = search_run["run_dir"]
    record = json.loads((run_dir / "search.json").read_text())
    winner = next(c for c in record["candidates"] if c["name"] == record["winner"])
    assert winner["confirmed"] is not None and winner["confirmed"]["pairs"] >= 2
    top = json.loads((run_dir / "stages" / "benchmark-pair.json").read_text())
    mine = json.loads((run_dir / "candidates" / winner["name"] / "stages" / "benchmark-pair.json").read_text())
    assert top["key"] == mine["key"]  # the run's benchmark is the winner's confirmation
    manifest = json.loads((Path(top["path"]) / "manifest.json").read_text())
    n = yaml.safe_load((run_dir / "recipe.yaml").read_text())["evaluate"]["benchmark"]["num_prompts"]
    state = json.loads((run_dir / "state.json").read_text())
    # Fresh (keyed by this run) and held out (the set's next num_prompts prompts, which the screening never ran).
    confirmation = manifest["inputs"]["confirmation"]
    assert confirmation["prompts_held_out"] == [n, 2 * n] and confirmation["run"], confirmation
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{search_run['work'] / 'mlflow.db'}")
    benches = client.search_runs([client.get_experiment_by_name("kiln-test").experiment_id],
                                 "tags.`kiln.stage` = 'benchmark'")
    mine = [r.data.params["prompts"] for r in benches if r.data.tags["mlflow.parentRunId"] in {c.info.run_id for c in client.search_runs(
                [r.info.experiment_id], f"tags.`kiln.candidate` = '{winner['name']}' and "
                f"tags.`mlflow.parentRunId` = '{state['mlflow_parent']}'")}]
    assert len(mine) == 2 and mine[0] != mine[1], mine  # screening and confirmation ran different prompts
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert all(c["verdict"] == "Successful" for c in verdict["checks"]), verdict
    assert any("98.33%" in c["reason"] for c in verdict["checks"] if c["kind"] == "performance")  # 1 - 0.05/3, as taken
    engine = json.loads((run_dir / "stages" / "engine-candidate.json").read_text())
    assert engine["key"] == json.loads((run_dir / "candidates" / winner["name"] / "stages" /
                                        "engine-candidate.json").read_text())["key"]  # kiln serve RUN serves it
    # Cost per 1M output tokens at batch 1: the machine's price over the confirmed decode rate.
    tok_s = json.loads((Path(top["path"]) / "result.json").read_text())["metrics"]["candidate.decode_tok_s"]
    assert winner["decode_tok_s"] == pytest.approx(tok_s)
    assert winner["cost_per_1m"] == pytest.approx(2.0 / (tok_s * 3600) * 1e6)
    assert record["baseline"]["engine"] == "torch float32" and record["baseline"]["cost_per_1m"] > 0
    report = (run_dir / "report.md").read_text()
    assert "## Search" in report and "## Candidates" in report and f"🏆 {winner['name']}" in report
    assert "cost / 1M tokens (b1)" in report and "per 1M output tokens at €2.00 per machine-hour" in report
    # Every interval at the confidence the verdicts were taken at (95% shared by three), not at 95%.
    assert "speed-up [CI at 98.33%]" in report and "perplexity change [CI at 98.33%]" in report
    assert winner["confirmed"]["confidence"] == pytest.approx(family_confidence(0.95, 3))
    assert "at 98.33%" in next(line for line in report.splitlines() if line.startswith("| perplexity |"))
    assert (run_dir / "plots" / "search_pareto.png").stat().st_size > 10_000


def test_each_candidate_is_an_mlflow_child_run(search_run):
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{search_run['work'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("kiln-test")
    runs = client.search_runs([exp.experiment_id], "tags.`kiln.stage` = 'candidate'")
    assert sorted(r.data.tags["kiln.candidate"] for r in runs) == sorted(c["name"] for c in CANDIDATES)
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1
    statuses = {r.data.tags["kiln.candidate"]: r.data.tags["kiln.search"] for r in runs}
    assert statuses == {"fp32-copy": "winner", "torch-int8": "eliminated", "ct2-int8": "eliminated"}
    winner = next(r for r in runs if r.data.tags["kiln.search"] == "winner")  # a person reads the tag, 3 figures
    assert re.fullmatch(r"[\d.]{1,5}x \[[\d.]{1,5}, [\d.]{1,5}\]", winner.data.tags["kiln.screening_speedup"])
    assert "screening_speedup.ratio" in winner.data.metrics  # ... and sorts by the metric, at full precision
    stages = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{runs[0].info.run_id}'")
    assert stages, "a candidate's stages are children of its run"
    # and name it: a rerun of a killed search on Ray finds where each candidate was built by it
    assert {s.data.tags["kiln.candidate"] for s in stages} == {runs[0].data.tags["kiln.candidate"]}


def test_a_second_run_reuses_every_stage_but_the_confirmation(search_run):
    """The confirmation is measured again by every run: never reused from the cache or the server."""
    second = kiln("run", str(search_run["recipe"]), cwd=search_run["work"])
    assert second.returncode == search_run["proc"].returncode, second.stdout[-3000:] + second.stderr[-3000:]
    computed = [line for line in second.stdout.splitlines() if "▶" in line]
    assert len(computed) == 1 and "fp32-copy: benchmark[pair]" in computed[0], computed
    # ... as its plan said before the first stage, with the times the first run took
    plan = second.stdout[second.stdout.index("plan: "):second.stdout.index("▶")]
    assert "\n  baseline: to run: nothing; reused from the cache: optimize[baseline], engine[baseline]" in plan, plan
    assert "\n  fp32-copy: to run: nothing; reused from the cache: optimize[candidate]" in plan, plan
    assert re.search(r"then the winner's confirmation benchmark \(~\d[\dhms]*\)", plan), plan
    assert re.search(r"\d+ reused; about \d", plan), plan


def test_phases_put_cheap_checks_first():
    policy = GateSection.model_validate({"checks": CHECKS + [
        {"kind": "quality", "metric": "word_swap_acc", "margin": 0.1},
        {"kind": "performance", "metric": "load_goodput", "min_ratio": 1.0}]})
    assert [phase_of(c) for c in policy.checks] == ["build", "quality", "agreement", "speed", "rest", "rest", "rest"]
    assert up_to(policy, "build").checks == policy.checks[:1]
    assert up_to(policy, "quality").checks == policy.checks[:2]  # perplexity decided before agreement runs
    assert len(up_to(policy, "speed").checks) == 4 and up_to(policy, PHASES[-1]).checks == policy.checks
    family = for_family(policy, 4)
    assert family.confidence == pytest.approx(0.9875) and policy.confidence == 0.95


def test_a_registered_eval_decides_its_checks_in_its_own_phase(monkeypatch):
    """A check on a new eval's metric waits for that eval's phase, whatever the check's kind: an agreement
    check on an eval that runs with token agreement is judged there, one on a last-phase eval at the end."""
    from pydantic import Field

    from kiln.core.metrics import METRICS, Metric
    from kiln.evaluate.quality.base import QUALITY_EVALS, QualityEval

    for phase in ("agreement", "rest"):
        monkeypatch.setitem(METRICS, f"toy_{phase}", Metric(f"toy_{phase}", True, "", "a toy", "quality",
                                                            f"evaluate.quality.toy_{phase}", None))
        toy = type(f"Toy{phase}", (QualityEval,), {"section": Field(None), "stage": "toy", "phase": phase})
        monkeypatch.setitem(QUALITY_EVALS._plugins, f"toy_{phase}", toy)
    policy = GateSection.model_validate({"checks": [
        {"kind": "agreement", "metric": "toy_agreement", "min": 0.5},
        {"kind": "agreement", "metric": "toy_rest", "min": 0.5},
        {"kind": "quality", "metric": "toy_agreement", "margin": 0.1}]})
    assert [phase_of(c) for c in policy.checks] == ["agreement", "rest", "agreement"]


def test_the_benchmark_stops_on_the_speed_checks_only_each_at_a_share_of_the_confidence():
    from types import SimpleNamespace

    from kiln.core.gate.base import Evidence, Verdict
    from kiln.pipeline.stages.benchmark import futility_policy

    family = for_family(GateSection.model_validate({"confidence": 0.95, "checks": CHECKS}), 3)
    looks = futility_policy(SimpleNamespace(gate=family, recipe=None), rounds=4)
    assert [c.metric for c in looks.checks] == ["decode_tok_s"]
    assert looks.confidence == pytest.approx(1 - (1 - family.confidence) / 4)
    assert futility_policy(SimpleNamespace(gate=family, recipe=None), rounds=1) is None
    quality_only = family.model_copy(update={"checks": family.checks[:3]})
    assert futility_policy(SimpleNamespace(gate=quality_only, recipe=None), rounds=4) is None
    # What a look calls Failed, the final judgment on the same pairs calls Failed too.
    rng = np.random.default_rng(0)
    stopped = 0
    floor = next(c["min_ratio"] for c in CHECKS if c.get("metric") == "decode_tok_s")
    for ratio in (floor / 3, floor * 5 / 6, floor * 0.97, floor * 1.03, floor * 5 / 3):  # around the floor
        base = list(rng.uniform(9, 11, 8))
        cand = [b * ratio * rng.lognormal(0, 0.1) for b in base]
        ev = Evidence("candidate", repeats={"decode_tok_s": cand}), Evidence("baseline", repeats={"decode_tok_s": base})
        early = judge(looks, *ev).verdict
        final = judge(family.model_copy(update={"checks": looks.checks}), *ev).verdict
        assert early is not Verdict.FAILED or final is Verdict.FAILED, (ratio, early, final)
        stopped += early is Verdict.FAILED
    assert stopped  # the property was exercised: some look did stop


@pytest.mark.parametrize(("change", "needle"), [
    ({"optimize": {"method": "none"}}, "move them there"),
    ({"candidates": CANDIDATES[:1] * 2}, "torch-int8 appears more than once"),
    ({"candidates": [{**CANDIDATES[1], "optimize": {"method": "int8_weight_only"}}]}, "candidates.0.engine.backend"),
    ({"candidates": []}, "candidates"),
])
def test_a_bad_search_recipe_names_its_field(change, needle):
    from pydantic import ValidationError

    raw = {k: v for k, v in TINY_RECIPE.items() if k not in ("optimize", "engine")}
    raw = {**raw, "model": {"path": "demo"}, "candidates": CANDIDATES, **change}
    with pytest.raises(ValidationError, match=needle):
        Recipe.model_validate(raw)


def test_the_single_candidate_form_still_validates_and_names_a_missing_optimize():
    from pydantic import ValidationError

    assert Recipe.model_validate({**TINY_RECIPE, "model": {"path": "demo"}}).arms()[0][0] == "candidate"
    with pytest.raises(ValidationError, match="optimize: required"):
        Recipe.model_validate({k: v for k, v in TINY_RECIPE.items() if k != "optimize"})


def test_a_search_no_candidate_passes_is_a_gate_failure_not_an_error(search_run, tmp_path):
    """Only the speed check changed: every stage but the benchmark is reused, and the benchmark,
    whose key holds the checks it may stop on, stops before its last round, already Failed."""
    raw = yaml.safe_load(search_run["recipe"].read_text())
    raw["gate"]["checks"][3]["min_ratio"] = 100.0  # no engine decodes 100x faster
    raw["tracking"]["registered_model"] = "tiny-search-impossible"  # another policy: tiny-search pins its own
    recipe = tmp_path / "impossible.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = kiln("run", str(recipe), cwd=search_run["work"])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "a fresh decode benchmark" not in proc.stdout  # no winner: nothing to confirm
    run_dir = max((search_run["work"] / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    record = json.loads((run_dir / "search.json").read_text())
    assert record["winner"] is None and all(c["eliminated"] for c in record["candidates"])
    [timed] = [c for c in record["candidates"] if c["reached"] == "speed"]
    rounds = raw["evaluate"]["benchmark"]["repeats"]
    # Round 1's few pairs may leave even 100x undecided at the looks' stricter level on a busy
    # machine (seen in CI under two workers: stopped after round 2 of 3); it must stop before the end.
    stopped = re.search(rf"benchmark stopped after round (\d+) of {rounds}\b", timed["eliminated"])
    assert stopped and int(stopped[1]) < rounds, timed
    repeats = json.loads((run_dir / "candidates" / timed["name"] / "stages" / "benchmark-pair.json").read_text())
    samples = json.loads((Path(repeats["path"]) / "repeats.json").read_text())
    assert len(samples["candidate"]["decode_tok_s"]) == raw["evaluate"]["benchmark"]["num_prompts"] * int(stopped[1])
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert {c["verdict"] for c in verdict["checks"]} <= {"Successful", "Failed", "Inconclusive"}, verdict
    assert "no candidate passed every check" in verdict["summary"] and verdict["exit_code"] == 1
    # The checks its phases never reached are in the verdict, not judged, never dropped.
    never = [c for c in verdict["checks"] if c["reason"].startswith("not judged")]
    assert [c["name"] for c in never] == ["agreement:served_prefix"], verdict["checks"]


def test_a_resolved_search_recipe_reloads():
    """run_dir/recipe.yaml is the resolved recipe: optimize null, the default engine, every candidate."""
    raw = {k: v for k, v in TINY_RECIPE.items() if k not in ("optimize", "engine")}
    r = Recipe.model_validate({**raw, "model": {"path": "demo"}, "candidates": CANDIDATES})
    again = Recipe.model_validate(yaml.safe_load(yaml.safe_dump(r.model_dump(mode="json"))))
    assert again == r and [name for name, _ in again.arms()] == [c["name"] for c in CANDIDATES]


def test_the_champion_is_a_candidate_served_as_it_was_judged(search_run, tmp_path):
    """After `kiln promote`, a search listing `champion: true` serves the registry's champion (its
    recorded engine, its artifact downloaded from the store) beside the new candidates."""
    import mlflow

    work = search_run["work"]
    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    winner = client.get_model_version_by_alias("tiny-search", "challenger")
    serving = json.loads(winner.tags["kiln.serving"])
    assert serving["engine"]["backend"] == "torch" and serving["optimize"]["method"] == "none"
    assert kiln("promote", "tiny-search", str(winner.version), cwd=work).returncode == 0
    raw = yaml.safe_load(search_run["recipe"].read_text())
    raw["candidates"] = [{"name": "prod", "champion": True}, CANDIDATES[1]]
    recipe = tmp_path / "against-prod.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode in (0, 1, 3), proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    rows = {c["name"]: c for c in json.loads((run_dir / "search.json").read_text())["candidates"]}
    assert set(rows) == {"prod", "ct2-int8"} and rows["prod"]["engine"] == "torch float32"
    optimize = json.loads((run_dir / "candidates" / "prod" / "stages" / "optimize-candidate.json").read_text())
    inputs = json.loads((Path(optimize["path"]) / "manifest.json").read_text())["inputs"]
    assert inputs == {"champion": {"name": "tiny-search", "version": str(winner.version),
                                   "sha256": winner.tags["kiln.artifact_sha256"]}}
    engine = json.loads((run_dir / "candidates" / "prod" / "stages" / "engine-candidate.json").read_text())
    first = json.loads((search_run["run_dir"] / "candidates" / "fp32-copy" / "stages" / "engine-candidate.json").read_text())
    assert engine["key"] == first["key"]  # the same engine, built from the same artifact and config


def test_a_champion_candidate_without_a_champion_is_left_out(tmp_path):
    from kiln.core.errors import BadInput

    raw = {k: v for k, v in TINY_RECIPE.items() if k not in ("optimize", "engine")}
    r = Recipe.model_validate({**raw, "model": {"path": "demo"},
                               "candidates": [{"name": "prod", "champion": True}, CANDIDATES[0]]})
    assert [n for n, _ in r.with_champion(None).arms()] == ["torch-int8"]
    served = r.with_champion({"optimize": {"method": "none"}, "engine": {"backend": "torch", "threads": 1}})
    assert [(n, v.engine.threads) for n, v in served.arms()] == [("prod", 1), ("torch-int8", 2)]
    alone = Recipe.model_validate({**raw, "model": {"path": "demo"}, "candidates": [{"name": "prod", "champion": True}]})
    with pytest.raises(BadInput, match="promote a version first"):
        alone.with_champion(None)
    with pytest.raises(ValueError, match="leave out its optimize and engine"):
        Recipe.model_validate({**raw, "candidates": [{"name": "p", "champion": True, "optimize": {"method": "none"}}]})


def _variant(search_run, tmp_path: Path, name: str, **changes) -> tuple[Path, dict]:
    raw = yaml.safe_load(search_run["recipe"].read_text())
    for dotted, value in changes.items():
        node, *path = raw, *dotted.split("__")
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    return recipe, raw


def _challenger(client) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias("tiny-search", "challenger").version
    except MlflowException:
        return None


def _newest_run(work: Path) -> Path:
    return max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)


def test_a_search_whose_budget_runs_out_is_not_judged(search_run, tmp_path):
    """The issue's case: a speed bound nothing can meet and a budget that stops the search on the way.
    Judged on the checks that happened to run, it used to print Successful and exit 0."""
    import mlflow

    checks = yaml.safe_load(search_run["recipe"].read_text())["gate"]["checks"]
    checks[3]["min_ratio"] = 50.0
    recipe, _ = _variant(search_run, tmp_path, "budget", search__budget_s=0.5, gate__checks=checks,
                         tracking__registered_model="tiny-search-budget")  # another policy: tiny-search pins its own
    client = mlflow.MlflowClient(f"sqlite:///{search_run['work'] / 'mlflow.db'}")
    proc = kiln("run", str(recipe), cwd=search_run["work"])
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 3, printed[-3000:]
    assert "not judged" in printed and "search budget (0.5 s) ran out" in printed, printed[-3000:]
    assert "— ✅ Successful" not in printed and "Exit code 0" not in printed
    run_dir = _newest_run(search_run["work"])
    if (run_dir / "verdict.json").exists():  # the budget ran out after a build: the furthest one is reported
        verdict = json.loads((run_dir / "verdict.json").read_text())
        assert verdict["verdict"] == "Inconclusive" and verdict["exit_code"] == 3, verdict
        assert any(c["reason"].startswith("not judged") for c in verdict["checks"]), verdict
        registered = json.loads((run_dir / "registry.json").read_text())
        mv = client.get_model_version("tiny-search-budget", str(registered["version"]))
        assert mv.tags["kiln.passed"] == "false"
    with pytest.raises(Exception, match="alias"):  # never a version of this run
        client.get_model_version_by_alias("tiny-search-budget", "challenger")


def test_on_inconclusive_pass_never_waives_too_few_perplexity_documents_in_a_search(search_run, tmp_path):
    """12 perplexity documents are too few for torch-int8 to pass perplexity (24 needed; only identical
    records pass on fewer): Inconclusive on too little data, not an undecided interval. Even under
    `on_inconclusive: pass` it blocks, in a search as in a single run: the candidate stops there and the
    search has no winner (exit 3). It used to win with exit 0 (issue 52); an undecided interval on enough
    data is still accepted (tests/pipeline/test_gate.py, test_outcomes.py)."""
    checks = yaml.safe_load(search_run["recipe"].read_text())["gate"]["checks"]
    checks[2]["min"] = 0.9  # int8 on torch agrees 0.996-0.999 with fp32 on this model
    recipe, _ = _variant(search_run, tmp_path, "inconclusive-pass", gate__on_inconclusive="pass", gate__checks=checks,
                         tracking__registered_model="tiny-search-inconclusive",  # another policy than tiny-search's
                         evaluate__quality__perplexity__max_documents=12,
                         candidates=[c for c in CANDIDATES if c["name"] == "torch-int8"])
    proc = kiln("run", str(recipe), cwd=search_run["work"])
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = _newest_run(search_run["work"])
    record = json.loads((run_dir / "search.json").read_text())
    assert record["winner"] is None, record
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["verdict"] == "Inconclusive" and verdict["exit_code"] == 3, verdict
    assert "accepts that" not in verdict["summary"]
    [ppl] = [c for c in verdict["checks"] if c["name"] == "quality:perplexity"]
    assert ppl["verdict"] == "Inconclusive" and ppl["insufficient"] and "12 documents are too few" in ppl["reason"]


def test_a_champion_no_candidate_beats_is_kept_and_no_challenger_is_set(search_run, tmp_path):
    """The champion is the bar: a candidate identical in speed to it (the same weights and engine, a
    knob that does nothing at batch 1) passes every check against the checkpoint, is measured against
    the champion paired, is not shown faster, and the champion stays: exit 1, no new challenger."""
    import mlflow

    work = search_run["work"]
    client = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    # The first search's winner, fp32-copy, which `same` copies: not whatever holds `challenger` now,
    # which depends on the tests that ran before (another winner may be slower than fp32-b8).
    registered = json.loads((search_run["run_dir"] / "registry.json").read_text())
    champion = client.get_model_version("tiny-search", str(registered["version"]))
    assert json.loads((search_run["run_dir"] / "search.json").read_text())["winner"] == "fp32-copy"
    # Forced: a later run of the same artifact (the budget test's) may have re-tagged it not passed.
    promoted = kiln("promote", "tiny-search", str(champion.version), "--force", "--reason", "the duel's bar", cwd=work)
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    challenger_before = _challenger(client)  # None when the latest run of every version did not pass
    same = {"name": "fp32-b8", "optimize": {"method": "none"},
            "engine": {"backend": "torch", "threads": 2, "max_batch_size": 8}}
    # Its speed is judged against the champion only: the bound against the checkpoint, taken from 3 pairs
    # while the other test worker runs, went Inconclusive once in CI (exit 3, before the duel ran).
    checks = [c for c in CHECKS if c["kind"] != "performance"]
    recipe, _ = _variant(search_run, tmp_path, "vs-champion", candidates=[{"name": "prod", "champion": True}, same],
                         gate__checks=checks)
    # Another gate for tiny-search is a recorded decision; the champion stays the bar as it was judged.
    pinned = kiln("policy", "set", "tiny-search", str(recipe), "--reason", "speed judged against the champion", cwd=work)
    assert pinned.returncode == 0, pinned.stdout + pinned.stderr
    proc = kiln("run", str(recipe), cwd=work)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = _newest_run(work)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert verdict["summary"].startswith("the champion stays"), verdict["summary"]
    [duel] = [c for c in verdict["checks"] if c["kind"] == "champion"]
    assert duel["verdict"] == "Failed" and "not shown faster" in duel["reason"], duel
    assert duel["ci"][0] <= 1 <= duel["ci"][1] or duel["ci"][1] < 1, duel
    assert all(c["verdict"] == "Successful" for c in verdict["checks"] if c["kind"] != "champion"), verdict
    # Measured in this run, paired: the duel's benchmark interleaves the champion's engine and the candidate's.
    stage = json.loads((run_dir / "candidates" / "fp32-b8" / "versus-champion" / "stages" / "benchmark-pair.json").read_text())
    assert not stage["reused"]
    assert client.get_model_version_by_alias("tiny-search", "champion").version == champion.version
    assert _challenger(client) == challenger_before
    record = json.loads((run_dir / "search.json").read_text())
    assert record["winner"] is None and record["versus_champion"]["verdict"] == "Failed"
    assert "the champion stays" in (run_dir / "report.md").read_text()
