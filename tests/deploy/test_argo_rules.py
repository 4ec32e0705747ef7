"""Argo Rollouts' AnalysisRun rules (kiln.deploy.argo_rules) and `kiln deploy render` refusing what
they reject. The rule cases are those of Argo's utils/analysis/factory_test.go TestValidateMetrics
plus the three of issue 15; every recipe in recipes/ renders templates that pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.deploy.argo_rules import validate_metric, validate_metrics, validate_rollout
from kiln.deploy.config import CanaryStep, DeployConfig, KubernetesConfig
from kiln.deploy.kubernetes import render
from kiln.core.errors import BadInput
from kiln.core.gate.policy import GateSection
from kiln.pipeline.recipe.schema import load_recipe

REPO = Path(__file__).parents[2]
PROM = {"prometheus": {"address": "http://p", "query": "up"}}

# (metric, Argo's error or None). Limits default to 0 when absent, as in Go.
METRIC_CASES = [
    ({"name": "m", "count": 1, "failureLimit": 2, "provider": PROM},
     "count (1) must be >= failureLimit + consecutiveSuccessLimit (2 + 0) if both >= 0"),
    ({"name": "m", "count": 2, "interval": "1m", "failureLimit": 2, "provider": PROM}, None),
    ({"name": "m", "count": 1, "inconclusiveLimit": 2, "provider": PROM}, "count must be >= inconclusiveLimit"),
    ({"name": "m", "count": 5, "interval": "60s", "failureLimit": 2, "provider": PROM}, None),
    ({"name": "m", "count": 5, "interval": "60s-typo", "provider": PROM}, "invalid interval string"),
    ({"name": "m", "count": 5, "interval": "1m", "initialDelay": "ten", "provider": PROM}, "invalid startDelay string"),
    ({"name": "m", "count": 2, "provider": PROM}, "interval must be specified when count > 1"),
    ({"name": "m", "failureLimit": -2, "provider": PROM}, "failureLimit must be >= 0, or -1 to be disabled"),
    ({"name": "m", "inconclusiveLimit": -1, "provider": PROM}, "inconclusiveLimit must be >= 0"),
    ({"name": "m", "consecutiveErrorLimit": -1, "provider": PROM}, "consecutiveErrorLimit must be >= 0"),
    ({"name": "m", "count": 1}, "no provider specified"),
    ({"name": "m", "provider": {**PROM, "web": {"url": "http://x"}}}, "multiple providers specified"),
    ({"name": "m", "consecutiveSuccessLimit": -1, "provider": PROM}, "consecutiveSuccessLimit must be >= 0"),
    ({"name": "m", "consecutiveSuccessLimit": 0, "failureLimit": -1, "provider": PROM},
     "failureLimit and consecutiveSuccessLimit cannot both be disabled"),
    # issue 15: a step gate whose count (max_duration_s / interval) is below the successes it needs
    ({"name": "m", "count": 2, "interval": "1m", "consecutiveSuccessLimit": 3, "failureLimit": -1, "provider": PROM},
     "count must be >= consecutiveSuccessLimit"),
    ({"name": "m", "count": 3, "interval": "1m", "consecutiveSuccessLimit": 3, "failureLimit": -1, "provider": PROM}, None),
    # issue 15: the old hold rendering, failureLimit = count
    ({"name": "m", "count": 5, "interval": "1m", "consecutiveSuccessLimit": 3, "failureLimit": 5, "provider": PROM},
     "count (5) must be >= failureLimit + consecutiveSuccessLimit (5 + 3) if both >= 0"),
    ({"name": "m", "count": 5, "interval": "1m", "consecutiveSuccessLimit": 3, "failureLimit": 2,
      "inconclusiveLimit": 5, "provider": PROM}, None),
    ({"name": "m", "interval": "1m", "failureLimit": 2, "provider": PROM}, None),  # background: runs until stopped
]


@pytest.mark.parametrize(("metric", "error"), METRIC_CASES)
def test_metric_rules_match_argo(metric, error):
    broken = validate_metric(metric)
    if error is None:
        assert broken is None
    else:
        assert broken is not None and broken[1].startswith(error), broken


def test_metric_names_are_unique_and_a_template_has_metrics():
    m = {"name": "success-rate", "provider": PROM}
    assert [v.message for v in validate_metrics("t", [m, dict(m)])] == ["metrics[1]: duplicate name 'success-rate'"]
    assert [v.message for v in validate_metrics("t", [])] == ["no metrics specified"]


def _rollout(steps: list[dict], background: dict | None = None) -> dict:
    canary: dict = {"steps": steps}
    if background:
        canary["analysis"] = background
    return {"kind": "Rollout", "spec": {"strategy": {"canary": canary}}}


def _template(name: str, metrics: list[dict], args: list[str]) -> dict:
    return {"kind": "AnalysisTemplate", "metadata": {"name": name},
            "spec": {"args": [{"name": a} for a in args], "metrics": metrics}}


def test_run_rules_args_indefinite_steps_and_names_across_templates():
    q = {"name": "q", "count": 3, "interval": "1m", "consecutiveSuccessLimit": 3, "failureLimit": -1,
         "provider": {"prometheus": {"address": "http://p", "query": "x{h='{{args.canary-hash}}'}"}}}
    t = _template("t", [q], ["canary-hash"])
    ok = _rollout([{"analysis": {"templates": [{"templateName": "t"}], "args": [{"name": "canary-hash", "value": "a"}]}}])
    assert validate_rollout([t, ok]) == []
    unsupplied = _rollout([{"analysis": {"templates": [{"templateName": "t"}], "args": [{"name": "other", "value": "a"}]}}])
    assert [v.message for v in validate_rollout([t, unsupplied])] == ["args.canary-hash was not resolved"]
    undeclared = _template("t", [q], [])
    assert [v.message for v in validate_rollout([undeclared, ok])] == ["failed to resolve {{args.canary-hash}}"]
    forever = _template("t", [{k: v for k, v in q.items() if k != "count"}], ["canary-hash"])
    assert "runs indefinitely" in validate_rollout([forever, ok])[0].message
    as_background = _rollout([], {"templates": [{"templateName": "t"}], "args": [{"name": "canary-hash", "value": "a"}]})
    assert validate_rollout([forever, as_background]) == []  # a background analysis may run until stopped
    both = _rollout([{"analysis": {"templates": [{"templateName": "t"}, {"templateName": "u"}],
                                   "args": [{"name": "canary-hash", "value": "a"}]}}])
    u = _template("u", [q], ["canary-hash"])
    assert [v.message for v in validate_rollout([t, u, both])] == ["two metrics have the same name 'q'"]
    assert "not found" in validate_rollout([t, both])[0].message


TTFT_BOTH = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.1},
    {"kind": "performance", "metric": "ttft_ms", "max": 500},
    {"kind": "error_rate", "max": 0.01}]})


@pytest.mark.parametrize("on_inconclusive", ["rollback", "hold"])
def test_every_recipe_renders_what_argo_accepts(on_inconclusive):
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        recipe = load_recipe(path)
        policy = recipe.gate if any(c.kind in ("performance", "error_rate") for c in recipe.gate.checks) else TTFT_BOTH
        deploy = recipe.deploy.model_copy(update={"on_inconclusive": on_inconclusive})
        docs = list(yaml.safe_load_all(render(recipe.name, policy, deploy).yaml()))
        assert validate_rollout(docs) == [], path.name


def test_a_ttft_ratio_and_a_ttft_slo_get_two_names():
    docs = render("smol", TTFT_BOTH, DeployConfig()).documents
    step = next(d for d in docs if d["metadata"]["name"] == "smol-step")
    assert [m["name"] for m in step["spec"]["metrics"]] == [
        "performance-ttft-ms-max-ratio", "performance-ttft-ms-max", "error-rate"]
    assert validate_rollout(docs) == []


def test_hold_renders_what_argo_accepts_and_ends_inconclusive():
    docs = render("smol", TTFT_BOTH, DeployConfig(on_inconclusive="hold")).documents
    assert validate_rollout(docs) == []
    gate = next(d for d in docs if d["metadata"]["name"] == "smol-step")["spec"]["metrics"][0]
    # Argo's assessMetricStatus: count reached, consecutiveSuccessLimit not, failureLimit >= 0 and not
    # exceeded -> Inconclusive (pause). An empty result is an Inconclusive measurement (neither
    # condition holds), tolerated up to inconclusiveLimit = count.
    assert gate["failureLimit"] >= 0 and gate["consecutiveSuccessLimit"] > 0
    assert gate["inconclusiveLimit"] == gate["count"] >= gate["failureLimit"] + gate["consecutiveSuccessLimit"]
    assert gate["failureCondition"].startswith("len(result) > 0 && ")


def test_render_refuses_what_argo_rejects_naming_the_recipe_field():
    short = DeployConfig(steps=[CanaryStep(weight=50, max_duration_s=120)])  # count 2 < 3 successes
    with pytest.raises(BadInput) as e:
        render("smol", TTFT_BOTH, short)
    assert "deploy.steps[].max_duration_s" in str(e.value) and "deploy.kubernetes.consecutive_successes (3)" in str(e.value)
    assert "count must be >= consecutiveSuccessLimit" in str(e.value)
    hold = DeployConfig(on_inconclusive="hold", kubernetes=KubernetesConfig(failure_limit=4))
    with pytest.raises(BadInput, match=r"deploy.kubernetes.failure_limit \(4\).*\(4 \+ 3\)"):
        render("smol", TTFT_BOTH, hold)
    named = GateSection.model_validate({"checks": [{"kind": "error_rate", "max": 0.01, "name": "errors"},
                                                   {"kind": "error_rate", "max": 0.05, "name": "Errors"}]})
    with pytest.raises(BadInput, match=r"gate.checks\[0\].name, gate.checks\[1\].name: duplicate name 'errors'"):
        render("smol", named, DeployConfig())


def test_kiln_deploy_render_exits_2_naming_the_field(tmp_path):
    recipe = yaml.safe_load((REPO / "recipes" / "demo-int8.yaml").read_text())
    recipe["deploy"] = {"steps": [{"weight": 50, "max_duration_s": 60}]}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    r = subprocess.run([sys.executable, "-m", "kiln.pipeline", "deploy", "render", str(path), "--out",
                        str(tmp_path / "rollout.yaml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "deploy.steps[].max_duration_s" in r.stdout + r.stderr
    assert not (tmp_path / "rollout.yaml").exists()


def test_the_served_prefix_check_renders_on_the_routers_mirrored_scores():
    """The demo recipe's served_prefix >= 0.3 becomes a metric on the rendered router's mirrored scores,
    with the live gate's statistic, in the guard and the step gate (not at 100%: mirrors need
    stable), and Argo's rules hold; without mirroring it is skipped with the reason."""
    from kiln.deploy.config import RouterOptions
    from kiln.engine.serve import metric_names as names

    served = [c for c in load_recipe(REPO / "recipes" / "demo.yaml").gate.checks if c.metric == "served_prefix"]
    policy = GateSection(checks=[*TTFT_BOTH.checks, *served])
    for on_inconclusive in ("rollback", "hold"):
        deploy = DeployConfig(on_inconclusive=on_inconclusive, steps=[CanaryStep(weight=50), CanaryStep(weight=100)],
                              router=RouterOptions(mirror_fraction=0.1))
        docs = render("smol", policy, deploy).documents
        assert validate_rollout(docs) == []
        metrics = {d["metadata"]["name"]: {m["name"]: m for m in d["spec"]["metrics"]}
                   for d in docs if d["kind"] == "AnalysisTemplate"}
        assert "agreement-served-prefix" in metrics["smol-guard"]
        assert "agreement-served-prefix" not in metrics["smol-step-full"]
        step = metrics["smol-step"]["agreement-served-prefix"]
        assert step["successCondition"] == "len(result) > 0 && result[0] >= 0.3"
        query = step["provider"]["prometheus"]["query"]
        # the router's series, as Prometheus labels the rendered router's pods (app=<name>-router)
        router = next(d for d in docs if d["kind"] == "Deployment")
        assert router["spec"]["template"]["metadata"]["labels"] == {"app": "smol-router"}
        assert f'{names.ROUTER_MIRROR_PREFIX}_sum{{namespace="default",app="smol-router",pair="floor"}}' in query
        assert f'{names.ROUTER_MIRROR_PREFIX}_count{{namespace="default",app="smol-router",pair="canary"}}' in query
        # no pod hash on the router's series: the step gate reads them once the window holds only this walk's
        assert step["initialDelay"] == deploy.kubernetes.query_window
        assert "initialDelay" not in metrics["smol-guard"]["agreement-served-prefix"]
    rendered = render("smol", policy, DeployConfig())
    docs, warnings = rendered.documents, rendered.warnings
    assert not any(m["name"] == "agreement-served-prefix" for d in docs if d["kind"] == "AnalysisTemplate"
                   for m in d["spec"]["metrics"])
    assert any("agreement:served_prefix" in w and "mirror_fraction" in w for w in warnings), warnings
