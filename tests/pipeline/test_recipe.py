"""Recipes: every shipped recipe validates; bad ones fail with one line per problem and a path."""

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.core.errors import BadInput, ExitCode
from kiln.pipeline.recipe import Recipe, apply_overrides, load_recipe

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
