"""Recipes: every shipped recipe validates; bad ones fail with one line per problem and a path."""

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import BadInput, ExitCode
from kiln.pipeline.recipe.schema import Recipe, apply_overrides, load_recipe

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))
GATE = {"checks": [{"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True}]}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    r = load_recipe(path)
    assert r.name and r.gate.checks


def test_there_are_recipes():
    assert any(p.name == "demo.yaml" for p in RECIPES)


def _write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_every_problem_reported_with_its_path(tmp_path):
    p = _write(tmp_path, """
name: x
optimize: {method: gptq, bits: 3, group_sise: 64}
engine: {backend: torch}
gate: {checks: [{kind: performance, metric: decode_tok_s}]}
""")
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    lines = e.value.problems
    assert any(line.startswith("optimize.bits:") for line in lines), lines
    assert any(line.startswith("optimize.group_sise: unknown field") for line in lines), lines
    assert any(line.startswith("gate.checks.0") and "exactly one of" in line for line in lines), lines
    assert e.value.exit_code == ExitCode.BAD_INPUT


def test_unknown_plugin_did_you_mean(tmp_path):
    p = _write(tmp_path, "name: x\noptimize: {method: gptqq}\ngate: {checks: [{kind: size, max_ratio: 1}]}\n")
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    assert "optimize.method: unknown name 'gptqq'. Did you mean 'gptq'?" in str(e.value)


def test_overrides_win_and_are_validated(tmp_path):
    p = _write(tmp_path, "name: x\noptimize: {method: gptq, bits: 4}\ngate: {checks: [{kind: size, max_ratio: 1}]}\n")
    assert load_recipe(p, ["optimize.bits=8"]).optimize.bits == 8
    assert load_recipe(p, ["gate.checks.0.max_ratio=0.5"]).gate.checks[0].max_ratio == 0.5
    with pytest.raises(BadInput, match="optimize.bits"):
        load_recipe(p, ["optimize.bits=5"])
    with pytest.raises(BadInput, match="KEY=VALUE"):
        apply_overrides({}, ["optimize.bits"])


def test_digest_ignores_key_order_but_not_values(tmp_path):
    a = Recipe.model_validate({"name": "x", "optimize": {"method": "none"}, "gate": GATE})
    b = Recipe.model_validate({"gate": GATE, "optimize": {"method": "none"}, "name": "x"})
    c = Recipe.model_validate({"name": "y", "optimize": {"method": "none"}, "gate": GATE})
    assert a.digest() == b.digest() != c.digest()


def test_cli_validate_exit_codes(tmp_path):
    good = RECIPES[0]
    bad = _write(tmp_path, "name: x\noptimize: {method: nope}\n")
    ok = subprocess.run([sys.executable, "-m", "kiln.pipeline", "validate", str(good)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    no = subprocess.run([sys.executable, "-m", "kiln.pipeline", "validate", str(bad)], capture_output=True, text=True)
    assert no.returncode == ExitCode.BAD_INPUT
    assert "optimize.method" in no.stderr and "gate" in no.stderr
    missing = subprocess.run([sys.executable, "-m", "kiln.pipeline", "validate", str(tmp_path / "nope.yaml")],
                             capture_output=True, text=True)
    assert missing.returncode == ExitCode.BAD_INPUT and "not found" in missing.stderr
    for args, says in ((["validate", str(good), "--bogus"], "No such option"),
                       (["serve", str(tmp_path), "--port", "notanint"], "'--port'")):
        usage = subprocess.run([sys.executable, "-m", "kiln.pipeline", *args], capture_output=True, text=True)
        assert usage.returncode == ExitCode.BAD_INPUT and says in usage.stderr, usage.stderr
        assert "Traceback" not in usage.stderr



def test_cli_validate_lists_a_searchs_arms_one_per_line(tmp_path):
    search = _write(tmp_path, (RECIPES[0].parent / "demo.yaml").read_text()).read_text()
    search = search.replace("candidates:\n", "candidates:\n  - {name: prod, champion: true}\n", 1)
    path = _write(tmp_path, search)
    out = subprocess.run([sys.executable, "-m", "kiln.pipeline", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    r = load_recipe(path)
    assert f"a search over {len(r.candidates)} candidates" in lines[0]
    assert lines[1] == "  baseline: the checkpoint unchanged, engine=torch"
    for name, view in r.arms():
        assert f"  {name}: optimize={view.optimize.method}, engine={view.engine.backend}" in lines
    assert "  prod: the registry's champion, as it was served" in lines
    assert len(lines) == 2 + len(r.candidates)

def test_schema_lists_plugins():
    import json

    out = subprocess.run([sys.executable, "-m", "kiln.pipeline", "schema"], capture_output=True, text=True, check=True)
    schema = json.dumps(json.loads(out.stdout))
    for name in ("gptq", "int8_weight_only", "torch", "quality", "performance"):
        assert f'"{name}"' in schema


# --- every gate check is measured by a stage of the recipe, or the recipe is refused ----------------

UNMEASURED = """
name: unmeasured
optimize: {method: int8_weight_only}
gate:
  on_inconclusive: pass
  checks:
    - {kind: quality, metric: perplexity, margin: 0.05, relative: true}
    - {kind: size, max_ratio: 1.0}
    - {kind: performance, metric: decode_tok_s, min_ratio: 0.5}
    - {kind: error_rate, max: 0.001}
    - {kind: performance, metric: load_ttft_p95_ms, max: 0.001}
"""
LOAD = ("evaluate.load={shape: {kind: concurrent, concurrency: 2}, duration_s: 1.0, warmup: {seconds: 0.2}, "
        "cooldown: {seconds: 0.1}, output_tokens: 6, workload: {input_tokens: {mean: 16}}, repeats: 2}")


def test_a_check_no_stage_measures_is_refused_naming_the_check_and_the_section(tmp_path):
    """The issue's reproduction: error_rate and load_ttft_p95_ms with no evaluate.load used to validate,
    run, end Inconclusive and exit 0 under `on_inconclusive: pass`. Refused before any work instead."""
    p = _write(tmp_path, UNMEASURED)
    with pytest.raises(BadInput) as e:
        load_recipe(p)
    text = str(e.value)
    assert e.value.exit_code == ExitCode.BAD_INPUT
    assert "gate.checks.3 (error_rate:error_rate): no stage of this recipe measures error_rate: add evaluate.load" in text
    assert "gate.checks.4 (performance:load_ttft_p95_ms)" in text and text.count("add evaluate.load") == 2
    assert "gate.checks.0" not in text and "gate.checks.2" not in text  # perplexity, decode_tok_s: always measured
    assert load_recipe(p, [LOAD]).evaluate.load is not None  # with the load stage, the same gate validates


def test_kiln_validate_and_run_refuse_an_unmeasured_check_before_any_work(tmp_path):
    p = _write(tmp_path, UNMEASURED)
    for command in ("validate", "run"):
        proc = subprocess.run([sys.executable, "-m", "kiln.pipeline", command, str(p)], capture_output=True,
                              text=True, cwd=tmp_path)
        assert proc.returncode == ExitCode.BAD_INPUT, proc.stdout + proc.stderr
        assert "gate.checks.3 (error_rate:error_rate)" in proc.stderr and "evaluate.load" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()  # kiln run stopped at the recipe


@pytest.mark.parametrize("sets, needle", [
    ([], "gate.checks.1 (quality:word_swap_acc): no stage of this recipe measures word_swap_acc: add "
         "evaluate.quality.lmeval with word_swap in its tasks"),
    (["evaluate.quality.lmeval={tasks: [heldout]}"],
     "gate.checks.1 (quality:word_swap_acc): no stage of this recipe measures word_swap_acc: add word_swap to "
     "evaluate.quality.lmeval.tasks"),
    (["gate.checks.1={kind: agreement, metric: top1_agreement, min: 0.9}", "evaluate.quality.agreement=false"],
     "gate.checks.1 (agreement:top1_agreement): no stage of this recipe measures top1_agreement: set "
     "evaluate.quality.agreement: true"),
    (["gate.checks.1={kind: agreement, metric: served_prefix, min: 0.3}"],
     "gate.checks.1 (agreement:served_prefix): no stage of this recipe measures served_prefix: add "
     "evaluate.quality.served"),
    (["gate.checks.1={kind: performance, metric: load_cost_per_1m_output_tokens, max: 5}", LOAD],
     "add evaluate.load.price_per_hour"),
    (["gate.checks.1={kind: performance, metric: perplexity, max: 30}"],
     "gate.checks.1 (performance:perplexity): a performance check reads performance metrics, and 'perplexity' "
     "is a quality metric"),
    (["gate.checks.1={kind: performance, metric: bench_cpu_pressure, max: 0.5}"], "no check gates on it"),
    (["gate.checks.1={kind: quality, metric: wordswap_acc, margin: 0.03}"],
     "unknown metric 'wordswap_acc'. Did you mean 'word_swap_acc'?"),
])
def test_each_stage_measures_its_own_metrics(tmp_path, sets, needle):
    p = _write(tmp_path, "name: x\noptimize: {method: none}\ngate: {checks: [{kind: size, max_ratio: 1}, "
                         "{kind: quality, metric: word_swap_acc, margin: 0.03}]}\n")
    with pytest.raises(BadInput) as e:
        load_recipe(p, sets)
    assert needle in str(e.value), str(e.value)


def test_lmeval_metrics_follow_the_task_list_and_a_users_task_yaml(tmp_path):
    p = _write(tmp_path, "name: x\noptimize: {method: none}\ngate: {checks: [{kind: quality, metric: word_swap_acc, "
                         "margin: 0.03}, {kind: quality, metric: mine_acc, margin: 0.03}]}\n")
    task = tmp_path / "mine.yaml"
    task.write_text("task: mine\ndataset_path: json\noutput_type: multiple_choice\n")
    assert load_recipe(p, [f"evaluate.quality.lmeval={{tasks: [word_swap, {task}]}}"]).evaluate.quality.lmeval
    with pytest.raises(BadInput, match=r"gate.checks.1 \(quality:mine_acc\): unknown metric 'mine_acc'"):
        load_recipe(p, ["evaluate.quality.lmeval={tasks: [word_swap]}"])
    task.write_text("task: theirs\n")  # the YAML names another task: nothing measures mine_acc
    with pytest.raises(BadInput, match="unknown metric 'mine_acc'"):
        load_recipe(p, [f"evaluate.quality.lmeval={{tasks: [word_swap, {task}]}}"])


def test_a_search_recipe_is_held_to_the_same_rule(tmp_path):
    search = (RECIPES[0].parent / "demo.yaml").read_text()
    assert "candidates:" in search
    p = _write(tmp_path, search)
    checks = len(load_recipe(p).gate.checks)
    with pytest.raises(BadInput, match=rf"gate.checks.{checks} \(error_rate:error_rate\): .*add evaluate.load"):
        load_recipe(p, [f"gate.checks={[*_checks(p), {'kind': 'error_rate', 'max': 0.01}]}"])
    sized = load_recipe(p, [f"gate.checks={[*_checks(p), {'kind': 'size', 'max_ratio': 1.0}]}"])
    assert sized.optimize is None and sized.candidates  # the size is measured per candidate's build


def _checks(path):
    import yaml

    return yaml.safe_load(path.read_text())["gate"]["checks"]
