"""`kiln deploy render`: Argo Rollouts manifests from the gate policy, validated against the
Kubernetes, Argo Rollouts and KEDA schemas (npm @kubernetes-models: ajv + TypeScript)."""

from __future__ import annotations

import pytest
import yaml

from kiln.deploy.config import CanaryStep, DeployConfig, KubernetesConfig
from kiln.deploy.kubernetes import KubernetesTarget, render
from kiln.core.errors import KilnError
from kiln.core.gate.policy import GateSection

POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.1},
    {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.9},
    {"kind": "performance", "metric": "tpot_ms", "max": 50},
    {"kind": "error_rate", "max": 0.01},
    {"kind": "quality", "metric": "perplexity", "margin": 0.05, "relative": True},
]})


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


VARIANTS = [
    KubernetesConfig(),
    KubernetesConfig(traffic_routing="nginx", ingress_host="llm.example.com", autoscaler="hpa", gpus=1,
                     latency_statistic="p95"),
    KubernetesConfig(autoscaler="none", replicas=20),
]


def test_rendered_manifests_validate_against_the_schemas(k8s_validator):
    docs = []
    for k8s in VARIANTS:  # one validator run for all variants: TypeScript is slow to start
        for on_inconclusive in ("rollback", "hold"):
            rendered = render("smol", POLICY, DeployConfig(kubernetes=k8s, on_inconclusive=on_inconclusive))
            docs += list(yaml.safe_load_all(rendered.yaml()))  # what kubectl would read
    report = k8s_validator(docs)
    assert report["ok"], report["errors"]
    assert len(report["checked"]) == len(docs)
    assert {"Rollout", "AnalysisTemplate", "Service", "Ingress", "ScaledObject", "HorizontalPodAutoscaler"} == {
        d["kind"] for d in docs}


def test_the_validator_catches_typos_and_wrong_types(k8s_validator):
    docs = render("smol", POLICY, DeployConfig()).documents
    rollout = by_kind(docs)["Rollout"][0]
    rollout["spec"]["strategy"]["canary"]["steps"][0] = {"setWieght": 5}
    by_kind(docs)["Service"][0]["spec"]["ports"][0]["port"] = "eighty"
    report = k8s_validator(docs)
    assert not report["ok"]
    text = "\n".join(report["errors"])
    assert "setWieght" in text and "must be integer" in text


def test_gate_policy_maps_onto_the_analysis_templates():
    rendered = render("smol", POLICY, DeployConfig())
    kinds = by_kind(rendered.documents)
    templates = {t["metadata"]["name"]: t for t in kinds["AnalysisTemplate"]}
    guard, step, full = templates["smol-guard"], templates["smol-step"], templates["smol-step-full"]
    assert [m["name"] for m in step["spec"]["metrics"]] == [
        "performance-ttft-ms-max-ratio", "performance-decode-tok-s-min-ratio", "performance-tpot-ms-max", "error-rate"]
    ttft = step["spec"]["metrics"][0]
    query = ttft["provider"]["prometheus"]["query"]
    assert 'kiln:time_to_first_token_seconds_sum{namespace="default",app="smol",' \
           'rollouts_pod_template_hash="{{args.canary-hash}}"}[5m]' in query
    assert "{{args.stable-hash}}" in query and ">= {{args.min-requests}}" in query
    assert ttft["successCondition"] == "len(result) > 0 && result[0] <= 1.1"
    assert ttft["failureLimit"] == -1 and ttft["consecutiveSuccessLimit"] == 3  # rollback when undecided
    assert guard["spec"]["metrics"][1]["failureCondition"] == "len(result) > 0 && result[0] < 0.9"
    assert "successCondition" not in guard["spec"]["metrics"][1]
    # 100% step: no stable traffic left, so only the absolute checks (SLO, error rate).
    assert [m["name"] for m in full["spec"]["metrics"]] == ["performance-tpot-ms-max", "error-rate"]
    assert any("quality:perplexity skipped" in w for w in rendered.warnings)


def test_rollout_steps_probes_services_and_autoscaler():
    config = DeployConfig(steps=[CanaryStep(weight=w, min_requests=100) for w in (5, 50, 100)])
    rendered = render("smol", POLICY, config)
    kinds = by_kind(rendered.documents)
    canary = kinds["Rollout"][0]["spec"]["strategy"]["canary"]
    assert [list(s)[0] for s in canary["steps"]] == ["setWeight", "analysis"] * 3
    assert [s["setWeight"] for s in canary["steps"][::2]] == [5, 50, 100]
    assert canary["steps"][-1]["analysis"]["templates"] == [{"templateName": "smol-step-full"}]
    assert {"name": "min-requests", "value": "100"} in canary["steps"][1]["analysis"]["args"]
    assert canary["analysis"]["templates"] == [{"templateName": "smol-guard"}]
    pod = kinds["Rollout"][0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # deployable as it stands: a key from a Secret on the 0.0.0.0 listener, the drain passed to
    # kiln serve and inside the grace period after the preStop wait
    args = container["args"]
    assert "--insecure-no-api-key" not in args and args[args.index("--host") + 1] == "0.0.0.0"
    assert container["env"] == [{"name": "KILN_API_KEY", "valueFrom": {"secretKeyRef": {"name": "smol-api-key",
                                                                                        "key": "api-key"}}}]
    drain = float(args[args.index("--drain-timeout") + 1])
    assert drain == config.router.admission.drain_timeout_s
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep" and pod["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + drain + 1
    assert any("smol-api-key" in w and "create secret" in w for w in rendered.warnings)
    assert {s["metadata"]["name"] for s in kinds["Service"]} == {"smol", "smol-stable", "smol-canary"}
    trigger = kinds["ScaledObject"][0]["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and "kiln:num_requests_waiting" in trigger["metadata"]["query"]
    # KEDA owns the count (minReplicaCount 1): at 1 pod a 5% step is the whole of the traffic
    assert any("5%" in w and "1/1 pods" in w and "KEDA minReplicaCount" in w for w in rendered.warnings)
    fixed = render("smol", POLICY, config.model_copy(update={"kubernetes": KubernetesConfig(autoscaler="none")}))
    assert any("5%" in w and "1/4 pods" in w and "Rollout replicas" in w for w in fixed.warnings)


def test_hold_renders_an_inconclusive_end_and_says_so():
    rendered = render("smol", POLICY, DeployConfig(on_inconclusive="hold"))
    step = next(t for t in rendered.documents if t["metadata"]["name"] == "smol-step")
    gate = step["spec"]["metrics"][0]
    assert gate["inconclusiveLimit"] == gate["count"] and gate["failureLimit"] == 2  # the guard's tolerance
    assert any("pauses the rollout" in w for w in rendered.warnings)


def test_a_policy_prometheus_cannot_express_is_refused():
    policy = GateSection.model_validate({"checks": [{"kind": "size", "max_ratio": 0.5}]})
    with pytest.raises(KilnError, match="no check can be expressed"):
        render("smol", policy, DeployConfig())


def test_the_kubernetes_target_points_at_argo_for_the_walk():
    target = KubernetesTarget("smol", POLICY, DeployConfig(target="kubernetes"))
    with pytest.raises(KilnError, match="kubectl argo rollouts promote smol"):
        target.promote()
    with pytest.raises(KilnError, match="Prometheus does not keep"):
        target.observe()
    assert target.render().documents
