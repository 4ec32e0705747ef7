"""`kiln deploy render`: Argo Rollouts manifests from the gate policy, validated against the
Kubernetes, Argo Rollouts and KEDA schemas (npm @kubernetes-models: ajv + TypeScript), with and
without the router in front (mirroring), every pod on the image kiln's Dockerfile builds."""

from __future__ import annotations

import re

import pytest
import yaml
from pydantic import ValidationError

from kiln.deploy.config import CanaryStep, DeployConfig, KubernetesConfig, RouterConfig, RouterOptions, kiln_version
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


MIRRORED = GateSection.model_validate({"checks": [*POLICY.model_dump()["checks"],
                                                  {"kind": "agreement", "metric": "served_prefix", "min": 0.6}]})


def test_rendered_manifests_validate_against_the_schemas(k8s_validator):
    docs = []
    for k8s in VARIANTS:  # one validator run for all variants: TypeScript is slow to start
        for on_inconclusive in ("rollback", "hold"):
            for mirror, policy in ((0.0, POLICY), (0.2, MIRRORED)):  # with mirroring, the router in front
                deploy = DeployConfig(kubernetes=k8s, on_inconclusive=on_inconclusive,
                                      router=RouterOptions(mirror_fraction=mirror))
                rendered = render("smol", policy, deploy, ("smol", "2"))
                docs += list(yaml.safe_load_all(rendered.yaml()))  # what kubectl would read
    report = k8s_validator(docs)
    assert report["ok"], report["errors"]
    assert len(report["checked"]) == len(docs)
    assert {"Rollout", "AnalysisTemplate", "Service", "Ingress", "ScaledObject", "HorizontalPodAutoscaler",
            "Deployment"} == {d["kind"] for d in docs}
    web = [m for d in docs if d["kind"] == "AnalysisTemplate" for m in d["spec"]["metrics"] if "web" in m["provider"]]
    assert web  # the router's weight step went through the AnalysisTemplate schema too


def test_the_validator_catches_typos_and_wrong_types(k8s_validator):
    docs = render("smol", MIRRORED, DeployConfig(router=RouterOptions(mirror_fraction=0.2))).documents
    rollout = by_kind(docs)["Rollout"][0]
    rollout["spec"]["strategy"]["canary"]["steps"][1] = {"setWieght": 5}
    by_kind(docs)["Service"][0]["spec"]["ports"][0]["port"] = "eighty"
    router = by_kind(docs)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    router["env"][0]["valueFrom"]["secretKeyRef"]["keey"] = router["env"][0]["valueFrom"]["secretKeyRef"].pop("key")
    router["ports"][0]["containerPort"] = "8080"
    report = k8s_validator(docs)
    assert not report["ok"]
    text = "\n".join(report["errors"])
    assert "setWieght" in text and "must be integer" in text and "keey" in text, text
    assert any("Deployment" in e and "containerPort" in e for e in report["errors"]), text


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


def _containers(docs: list[dict]) -> list[dict]:
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Rollout", "Deployment")]
    return [c for pod in pods for c in (*pod.get("initContainers", []), *pod["containers"])]


def test_every_pod_runs_the_image_kilns_dockerfile_builds_by_a_configurable_tag():
    mirrored = DeployConfig(router=RouterOptions(mirror_fraction=0.2))
    rendered = render("smol", MIRRORED, mirrored, ("smol", "2"))
    images = {c["name"]: c["image"] for c in _containers(rendered.documents)}
    assert images == {"kiln-verify": f"kiln:{kiln_version()}", "kiln-serve": f"kiln:{kiln_version()}",
                      "kiln-router": f"kiln:{kiln_version()}"}
    assert "kiln-serve:latest" not in rendered.yaml()
    assert any(w.startswith(f"image kiln:{kiln_version()}:") and f"docker build -t kiln:{kiln_version()} ." in w
               for w in rendered.warnings), rendered.warnings
    pushed = KubernetesConfig(image="registry.example.com:5000/team/kiln", image_tag="2026-12-07-abc123")
    retagged = render("smol", MIRRORED, mirrored.model_copy(update={"kubernetes": pushed}), ("smol", "2"))
    assert {c["image"] for c in _containers(retagged.documents)} == {"registry.example.com:5000/team/kiln:2026-12-07-abc123"}
    digest = KubernetesConfig(image="registry.example.com/kiln", image_tag="sha256:" + "a" * 64)
    assert digest.image_ref == "registry.example.com/kiln@sha256:" + "a" * 64
    for wrong, repository in (("kiln-serve:latest", "kiln-serve"), ("registry:5000/kiln:1.0", "registry:5000/kiln"),
                              ("kiln@sha256:" + "b" * 64, "kiln")):
        with pytest.raises(ValidationError, match=rf"repository alone \({re.escape(repository)}\).*image_tag"):
            KubernetesConfig(image=wrong)


def test_with_mirroring_the_router_fronts_both_arms_with_its_keys_from_the_secret():
    deploy = DeployConfig(steps=[CanaryStep(weight=10), CanaryStep(weight=50), CanaryStep(weight=100)],
                          router=RouterOptions(mirror_fraction=0.2, affinity="prefix"))
    rendered = render("smol", MIRRORED, deploy)
    kinds = by_kind(rendered.documents)
    [router] = kinds["Deployment"]
    assert router["metadata"]["name"] == "smol-router" and router["spec"]["replicas"] == 1  # one holder of the weight
    pod = router["spec"]["template"]
    assert pod["metadata"]["labels"] == {"app": "smol-router"}  # not app=smol: the arms' Services select that
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "kiln.deploy.router_process"]
    config = RouterConfig.model_validate_json(container["args"][0])
    assert config.host == "0.0.0.0" and config.port == 8080 == container["ports"][0]["containerPort"]
    assert (config.stable_url, config.canary_url, config.weight) == ("http://smol-stable", "http://smol-canary", 0)
    assert config.mirror_fraction == 0.2 and config.affinity == "prefix"  # the recipe's router options
    assert RouterOptions(**config.model_dump(exclude={"host", "port", "stable_url", "canary_url", "weight"})) \
        == deploy.router
    # the keys: from the Secret through the environment, never a literal, never on the command line
    keys = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert keys == {"KILN_ROUTER_API_KEY": {"name": "smol-api-key", "key": "api-key"},
                    "KILN_ROUTER_UPSTREAM_API_KEY": {"name": "smol-api-key", "key": "upstream-key"},
                    "KILN_ROUTER_ADMIN_KEY": {"name": "smol-api-key", "key": "admin-key"}}
    serve = kinds["Rollout"][0]["spec"]["template"]["spec"]["containers"][0]
    assert serve["env"] == [{"name": "KILN_API_KEY", "valueFrom": {"secretKeyRef": {"name": "smol-api-key",
                                                                                    "key": "upstream-key"}}}]
    assert any("smol-api-key (keys api-key, upstream-key, admin-key)" in w and "--from-literal=admin-key=<key>" in w
               for w in rendered.warnings), rendered.warnings
    # clients reach the router through `smol`; the arms' Services keep selecting the engines' pods
    services = {s["metadata"]["name"]: s["spec"]["selector"] for s in kinds["Service"]}
    assert services == {"smol": {"app": "smol-router"}, "smol-stable": {"app": "smol"}, "smol-canary": {"app": "smol"}}
    # the agreement checks read the router's pods, as Prometheus labels them
    step = next(t for t in kinds["AnalysisTemplate"] if t["metadata"]["name"] == "smol-step")
    agreement = next(m for m in step["spec"]["metrics"] if m["name"] == "agreement-served-prefix")
    assert 'namespace="default",app="smol-router",pair="canary"' in agreement["provider"]["prometheus"]["query"]


def test_each_step_sets_the_routers_weight_after_the_pods_are_sized():
    deploy = DeployConfig(steps=[CanaryStep(weight=10), CanaryStep(weight=50), CanaryStep(weight=100)],
                          router=RouterOptions(mirror_fraction=0.2))
    rendered = render("smol", MIRRORED, deploy)
    canary = by_kind(rendered.documents)["Rollout"][0]["spec"]["strategy"]["canary"]
    assert "trafficRouting" not in canary

    def step(s: dict) -> str:
        if "setWeight" in s:
            return f"pods {s['setWeight']}"
        [t] = s["analysis"]["templates"]
        args = {a["name"]: a.get("value") for a in s["analysis"]["args"]}
        return f"router {args['weight']}" if t["templateName"] == "smol-router-weight" else t["templateName"]
    assert [step(s) for s in canary["steps"]] == [
        "router 0", "pods 10", "router 10", "smol-step", "pods 50", "router 50", "smol-step", "pods 100", "router 100",
        "smol-step-full"]
    weight = next(t for t in rendered.documents if t["metadata"]["name"] == "smol-router-weight")
    [metric] = weight["spec"]["metrics"]
    web = metric["provider"]["web"]
    assert web["url"] == "http://smol.default.svc/admin/weight" and web["method"] == "POST"
    assert {"key": "Authorization", "value": "Bearer {{args.admin-key}}"} in web["headers"]
    assert {"name": "admin-key", "valueFrom": {"secretKeyRef": {"name": "smol-api-key", "key": "admin-key"}}} \
        in weight["spec"]["args"]
    # with the router splitting exactly, the pod counts say nothing about traffic: no such warning
    assert not any("pods (~" in w for w in rendered.warnings), rendered.warnings


def test_with_nginx_and_the_router_the_ingress_fronts_the_router():
    deploy = DeployConfig(router=RouterOptions(mirror_fraction=0.2),
                          kubernetes=KubernetesConfig(traffic_routing="nginx", ingress_host="llm.example.com"))
    rendered = render("smol", MIRRORED, deploy)
    kinds = by_kind(rendered.documents)
    assert "trafficRouting" not in kinds["Rollout"][0]["spec"]["strategy"]["canary"]
    [ingress] = kinds["Ingress"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == "smol" and {s["metadata"]["name"] for s in kinds["Service"]} == {
        "smol", "smol-stable", "smol-canary"}
    assert any("Argo's nginx trafficRouting is not used" in w for w in rendered.warnings)
    plain = by_kind(render("smol", POLICY, deploy.model_copy(update={"router": RouterOptions()})).documents)
    assert plain["Rollout"][0]["spec"]["strategy"]["canary"]["trafficRouting"] == {"nginx": {"stableIngress": "smol"}}
    assert "Deployment" not in plain


def test_without_mirroring_nothing_changes_shape():
    kinds = by_kind(render("smol", POLICY, DeployConfig()).documents)
    assert "Deployment" not in kinds
    assert not any(t["metadata"]["name"].endswith("router-weight") for t in kinds["AnalysisTemplate"])
