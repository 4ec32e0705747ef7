"""The Kubernetes deploy target: `kiln deploy render` writes Argo Rollouts manifests whose analysis
comes from the same gate policy the local controller judges (analysis_templates.py).

Rendered, as one YAML stream: the AnalysisTemplates; a Rollout running `kiln serve` (its API key
from a Secret, since it listens beyond loopback; readiness and startup probes on /health, which
answers 503 while warming up and while draining; a preStop wait while endpoints stop sending, then
SIGTERM and `--drain-timeout`, inside terminationGracePeriodSeconds) with the recipe's steps, each a setWeight then
the step gate, and the guard as background analysis from the start; Services `<name>-stable` and
`<name>-canary`, plus `<name>` for clients (split by pod counts) or an nginx Ingress
(trafficRouting, exact weights); and an autoscaler on the engines' queue depth, the signal that
predicts user pain (KEDA ScaledObject with a Prometheus trigger, or an HPA on an external metric).

The walk itself happens in the cluster (Argo's controller), so this target renders; its
set_traffic/observe/promote/rollback explain which kubectl command does that instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln.deploy.analysis_templates import ARGO, METRICS, analysis_templates, recipe_problems
from kiln.deploy.argo_rules import validate_rollout
from kiln.deploy.base import DeployTarget, Observations
from kiln.deploy.config import DeployConfig
from kiln.core.errors import BadInput, KilnError
from kiln.core.files import atomic_write_text
from kiln.core.gate.policy import GateSection

ARG_VALUES = [{"name": "canary-hash", "valueFrom": {"podTemplateHashValue": "Latest"}},
              {"name": "stable-hash", "valueFrom": {"podTemplateHashValue": "Stable"}}]


API_KEY = "api-key"  # the key in the Secret holding kiln serve's API key(s)
GRACE_MARGIN_S = 10  # kiln serve exits within its drain timeout (+1 s); the rest is start-up slack


def secret_name(name: str, k: Any) -> str:
    return k.api_key_secret or f"{name}-api-key"


def running_replicas(k: Any) -> tuple[int, str]:
    """Pods that really run at low load, and who decides: the autoscaler's minimum when it owns
    the count (KEDA minReplicaCount, HPA minReplicas), else the Rollout's replicas."""
    if k.autoscaler == "keda":
        return max(1, k.min_replicas), "KEDA minReplicaCount"
    if k.autoscaler == "hpa":
        return max(1, k.min_replicas), "HPA minReplicas"
    return k.replicas, "Rollout replicas"


@dataclass
class Rendered:
    documents: list[dict[str, Any]]
    warnings: list[str] = field(default_factory=list)

    def yaml(self) -> str:
        return yaml.safe_dump_all(self.documents, sort_keys=False)

    def write(self, path: Path) -> Path:
        atomic_write_text(Path(path), self.yaml())
        return Path(path)


TRUSTED_KEYS_DIR = "/etc/kiln/trusted"  # where the verify container finds the keys it trusts (a ConfigMap)


def verify_container(name: str, k: Any, verify: tuple[str, str]) -> dict[str, Any]:
    """An init container that runs `kiln verify MODEL VERSION --engine <model_path>` before the server
    starts: a pod whose engine is not the one the signed verdict names, byte for byte, or whose verdict
    does not verify or did not pass, never serves (the init container exits non-zero)."""
    model, version = verify
    return {"name": "kiln-verify", "image": k.image, "command": ["kiln"],
            "args": ["verify", model, version, "--engine", k.model_path],
            "env": [{"name": "MLFLOW_TRACKING_URI",
                     "valueFrom": {"secretKeyRef": {"name": f"{name}-tracking", "key": "uri"}}},
                    {"name": "KILN_TRUSTED_KEYS", "value": f"{TRUSTED_KEYS_DIR}/kiln.pub"}],
            "volumeMounts": [{"name": "kiln-trusted-keys", "mountPath": TRUSTED_KEYS_DIR, "readOnly": True}]}


def rollout(name: str, deploy: DeployConfig, has_full_gate: bool, warnings: list[str],
            verify: tuple[str, str] | None = None) -> dict:
    k = deploy.kubernetes
    steps = _steps(name, deploy, has_full_gate, warnings)
    canary: dict[str, Any] = {"canaryService": f"{name}-canary", "stableService": f"{name}-stable",
                              "analysis": {"templates": [{"templateName": f"{name}-guard"}], "startingStep": 0,
                                           "args": [*ARG_VALUES, {"name": "min-requests",
                                                                  "value": str(min(s.min_requests for s in deploy.steps))}]},
                              "steps": steps}
    return _rollout_tail(name, deploy, canary, verify)


def _steps(name: str, deploy: DeployConfig, has_full_gate: bool, warnings: list[str]) -> list[dict]:
    """Each canary step: its weight, then the step's analysis (none where nothing can judge it)."""
    k = deploy.kubernetes
    steps: list[dict] = []
    for s in deploy.steps:
        steps.append({"setWeight": int(round(s.weight))})
        template = f"{name}-step" if s.weight < 100 else f"{name}-step-full" if has_full_gate else None
        if template is None:
            warnings.append(f"step {s.weight:g}%: no stable traffic left to compare with and no absolute check: "
                            "no step analysis (the guard keeps running)")
            continue
        steps.append({"analysis": {"templates": [{"templateName": template}],
                                   "args": [*ARG_VALUES, {"name": "min-requests", "value": str(s.min_requests)}]}})
        if k.traffic_routing == "replicas" and s.weight < 100:
            running, owner = running_replicas(k)
            pods = math.ceil(s.weight / 100 * running)
            if abs(pods / running * 100 - s.weight) > 0.5:
                warnings.append(f"step {s.weight:g}%: with {running} replicas ({owner}) and no traffic router the "
                                f"canary gets {pods}/{running} pods (~{pods / running:.0%} of traffic); use "
                                "traffic_routing: nginx for exact weights")
    return steps


def _rollout_tail(name: str, deploy: DeployConfig, canary: dict[str, Any], verify: tuple[str, str] | None) -> dict:
    """The Rollout around its canary strategy: the pod running `kiln serve` (and `kiln verify` first)."""
    k = deploy.kubernetes
    if k.traffic_routing == "nginx":
        canary["trafficRouting"] = {"nginx": {"stableIngress": name}}
    drain = math.ceil(deploy.router.admission.drain_timeout_s)
    container: dict[str, Any] = {
        "name": "kiln-serve", "image": k.image, "command": ["kiln"],
        "args": ["serve", k.model_path, "--host", "0.0.0.0", "--port", str(k.port), "--drain-timeout", str(drain),
                 *(["--ttft-slo-ms", f"{k.ttft_slo_ms:g}"] if k.ttft_slo_ms else [])],
        # kiln serve refuses a non-loopback listener without a key: clients send 'Authorization: Bearer <key>'.
        "env": [{"name": "KILN_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret_name(name, k), "key": API_KEY}}}],
        "ports": [{"name": "http", "containerPort": k.port}],
        # Endpoints drop a terminating pod asynchronously: keep serving while they catch up, then drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(k.pre_stop_s)]}}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 90},
    }
    if k.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": k.gpus}}
    labels = {"app": name}
    return {"apiVersion": ARGO, "kind": "Rollout", "metadata": {"name": name, "namespace": k.namespace, "labels": labels},
            "spec": {"replicas": k.replicas, "revisionHistoryLimit": 3, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": {
                         "prometheus.io/scrape": "true", "prometheus.io/port": str(k.port), "prometheus.io/path": "/metrics"}},
                         # preStop, then SIGTERM: serve drains for up to --drain-timeout and exits.
                         "spec": {"terminationGracePeriodSeconds": k.pre_stop_s + drain + GRACE_MARGIN_S,
                                  "containers": [container], **_verified(name, k, verify)}},
                     "strategy": {"canary": canary}}}


def _verified(name: str, k: Any, verify: tuple[str, str] | None) -> dict[str, Any]:
    if verify is None:
        return {}
    return {"initContainers": [verify_container(name, k, verify)],
            "volumes": [{"name": "kiln-trusted-keys", "configMap": {"name": f"{name}-trusted-keys"}}]}


def services(name: str, deploy: DeployConfig) -> list[dict]:
    k = deploy.kubernetes

    def service(svc: str) -> dict:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": svc, "namespace": k.namespace, "labels": {"app": name}},
                "spec": {"selector": {"app": name},
                         "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}

    docs = [service(f"{name}-stable"), service(f"{name}-canary")]
    if k.traffic_routing == "replicas":
        docs.append(service(name))  # clients; the split is the ratio of canary to stable pods
    else:
        rule: dict[str, Any] = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
            "service": {"name": f"{name}-stable", "port": {"name": "http"}}}}]}}
        if k.ingress_host:
            rule["host"] = k.ingress_host
        docs.append({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                     "metadata": {"name": name, "namespace": k.namespace, "labels": {"app": name}},
                     "spec": {"ingressClassName": "nginx", "rules": [rule]}})
    return docs


def autoscaler(name: str, deploy: DeployConfig) -> list[dict]:
    """Scale on requests waiting for a slot: it rises before latency does, CPU says little on GPUs."""
    k = deploy.kubernetes
    target = {"apiVersion": ARGO, "kind": "Rollout", "name": name}
    meta = {"name": name, "namespace": k.namespace, "labels": {"app": name}}
    if k.autoscaler == "keda":
        query = f'sum({METRICS["waiting"]}{{namespace="{k.namespace}",app="{name}"}})'
        return [{"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
                 "spec": {"scaleTargetRef": target, "minReplicaCount": k.min_replicas,
                          "maxReplicaCount": k.max_replicas,
                          "triggers": [{"type": "prometheus", "metadata": {
                              "serverAddress": k.prometheus_url, "query": query,
                              "threshold": f"{k.queue_per_replica:g}"}}]}}]
    if k.autoscaler == "hpa":
        metric = {"name": METRICS["waiting"].replace(":", "_"), "selector": {"matchLabels": {"app": name}}}
        return [{"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta,
                 "spec": {"scaleTargetRef": target, "minReplicas": max(1, k.min_replicas), "maxReplicas": k.max_replicas,
                          "metrics": [{"type": "External", "external": {
                              "metric": metric, "target": {"type": "AverageValue",
                                                           "averageValue": f"{k.queue_per_replica:g}"}}}]}}]
    return []


def render(name: str, policy: GateSection, deploy: DeployConfig, verify: tuple[str, str] | None = None) -> Rendered:
    """Every manifest for one model, plus warnings for what the policy asks that Argo cannot do. `verify`
    (registered model, version): each pod checks that version's signed verdict before it serves."""
    warnings: list[str] = _verify_warnings(name, deploy, verify)
    templates = analysis_templates(name, policy, deploy, warnings)
    has_full = any(t["metadata"]["name"] == f"{name}-step-full" for t in templates)
    warnings.append(f"Secret {secret_name(name, deploy.kubernetes)} (key {API_KEY}) must exist before the Rollout: "
                    f"kubectl -n {deploy.kubernetes.namespace} create secret generic {secret_name(name, deploy.kubernetes)} "
                    f"--from-literal={API_KEY}=<key> (several comma-separated keys = several tenants)")
    if deploy.kubernetes.autoscaler == "hpa":
        warnings.append("hpa: needs an external-metrics adapter (e.g. prometheus-adapter) exposing "
                        f"{METRICS['waiting'].replace(':', '_')}")
    docs = [*templates, rollout(name, deploy, has_full, warnings, verify), *services(name, deploy),
            *autoscaler(name, deploy)]
    violations = validate_rollout(docs)
    if violations:  # Argo would put every such AnalysisRun in Error and abort the rollout
        raise BadInput("deploy: Argo Rollouts would reject the rendered analysis at run time "
                       "(its AnalysisRun validation); change the recipe fields named:",
                       recipe_problems(violations, policy, deploy))
    return Rendered(docs, warnings)


def _verify_warnings(name: str, deploy: DeployConfig, verify: tuple[str, str] | None) -> list[str]:
    ns = deploy.kubernetes.namespace
    if verify is None:
        return ["rendered without --model-version: the pods serve whatever engine the image holds, and nothing checks "
                "it against a signed verdict; render with --model-version VERSION to add the kiln-verify init container"]
    return [f"Secret {name}-tracking (key uri) must hold the tracking server's URI for the kiln-verify init "
            f"container: kubectl -n {ns} create secret generic {name}-tracking --from-literal=uri=<MLFLOW_TRACKING_URI>",
            f"ConfigMap {name}-trusted-keys (key kiln.pub) must hold the public key your verdicts are signed with: "
            f"kubectl -n {ns} create configmap {name}-trusted-keys --from-file=kiln.pub=<(kiln key show)"]


class KubernetesTarget(DeployTarget):
    """Renders; the walk runs in the cluster under Argo Rollouts, so the live calls say how instead."""

    name = "kubernetes"

    def __init__(self, name: str, policy: GateSection, deploy: DeployConfig):
        self.app, self.policy, self.deploy = name, policy, deploy

    def render(self) -> Rendered:
        return render(self.app, self.policy, self.deploy)

    def _in_cluster(self, what: str, command: str) -> KilnError:
        return KilnError(f"kubernetes target: {what} is done in the cluster by Argo Rollouts, not by kiln. "
                         f"Apply the rendered manifests (kubectl apply -f) and use `{command}`.")

    def set_traffic(self, weight: float) -> None:
        raise self._in_cluster("setting the canary weight", f"kubectl argo rollouts set weight {self.app} {weight:g}")

    def observe(self, cursor: tuple[int, int] = (0, 0)) -> Observations:
        raise KilnError("kubernetes target: observe() needs per-request observations, which Prometheus does not "
                        "keep (only histograms). In the cluster the rendered AnalysisTemplates judge the canary; "
                        f"query {self.deploy.kubernetes.prometheus_url} yourself, or run `kiln route` in front of "
                        "both Services and use the local target's controller against it.")

    def promote(self) -> None:
        raise self._in_cluster("promotion", f"kubectl argo rollouts promote {self.app}")

    def rollback(self) -> None:
        raise self._in_cluster("rollback", f"kubectl argo rollouts abort {self.app}")
