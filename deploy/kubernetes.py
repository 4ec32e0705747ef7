"""The Kubernetes deploy target (`deploy.target: kubernetes`): Argo Rollouts manifests whose analysis
comes from the same gate policy the local controller judges (analysis_templates.py), and the walk
they describe, run in a cluster.

Rendered, as one YAML stream: the AnalysisTemplates; a Rollout running `kiln serve` (its API key
from a Secret, since it listens beyond loopback; readiness and startup probes on /health, which
answers 503 while warming up and while draining; a preStop wait while endpoints stop sending, then
SIGTERM and `--drain-timeout`, inside terminationGracePeriodSeconds) with the recipe's steps, each a setWeight then
the step gate, and the guard as background analysis from the start; Services `<name>-stable` and
`<name>-canary`, plus `<name>` for clients (split by pod counts) or an nginx Ingress
(trafficRouting, exact weights); and an autoscaler on the engines' queue depth, the signal that
predicts user pain (KEDA ScaledObject with a Prometheus trigger, or an HPA on an external metric).
Every pod runs the image `deploy.kubernetes.image:image_tag`, by default the one kiln's Dockerfile
builds (`kiln:<kiln's version>`).

With mirroring (deploy.router.mirror_fraction > 0) the router is rendered in front of both arms
(router_manifests.py): a Deployment `<name>-router` running `python -m kiln.deploy.router_process`
on 0.0.0.0 with its keys from the Secret, behind the client Service `<name>`. It scores the mirrored
prompts the agreement checks read, and it splits the traffic by exact weights: each step sets its
weight on the router (the `<name>-router-weight` analysis) after the setWeight that sizes the pods.

`kiln deploy render` writes the manifests for a cluster kiln does not reach. `kiln deploy canary` on
this target (KubernetesTarget) checks that kubectl reaches a cluster holding what the manifests need
(kubectl.py), applies them and follows Argo's walk to its end; kiln's own controller does not step
this target, so set_traffic/observe/promote/rollback name the kubectl command that does it instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kiln.deploy.analysis_templates import (ADMIN_KEY, API_KEY, ARGO, METRICS, UPSTREAM_KEY, analysis_templates,
                                            duration_s, recipe_problems, routed, router_weight_template, secret_name)
from kiln.deploy.argo_rules import validate_rollout
from kiln.deploy.base import DeployRequest, DeployTarget, Observations
from kiln.deploy.config import DeployConfig, KubernetesConfig
from kiln.deploy.kubectl import Kubectl, Required, outcome
from kiln.deploy.router_manifests import router_deployment, router_service
from kiln.deploy.targets import TARGETS
from kiln.core.errors import BadInput, ExitCode, KilnError
from kiln.core.files import atomic_write_text
from kiln.core.gate.policy import GateSection

if TYPE_CHECKING:  # the journal's records load scipy (core.stats): imported where a walk needs them
    from kiln.deploy.journal import CanaryJournal, CanaryResult

ARG_VALUES = [{"name": "canary-hash", "valueFrom": {"podTemplateHashValue": "Latest"}},
              {"name": "stable-hash", "valueFrom": {"podTemplateHashValue": "Stable"}}]


GRACE_MARGIN_S = 10  # kiln serve exits within its drain timeout (+1 s); the rest is start-up slack
STARTUP_S = 90 * 10 + 300  # the startup probe's patience, and slack for scheduling and image pulls
FOLLOW_ERRORS = 5  # kubectl calls failing in a row before kiln stops following a walk


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
    requires: list[Required] = field(default_factory=list)  # what the pods read that the manifests do not create

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
    return {"name": "kiln-verify", "image": k.image_ref, "command": ["kiln"],
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


def _router_weight(name: str, weight: float) -> dict:
    return {"analysis": {"templates": [{"templateName": f"{name}-router-weight"}],
                         "args": [{"name": "weight", "value": f"{weight:g}"}]}}


def _steps(name: str, deploy: DeployConfig, has_full_gate: bool, warnings: list[str]) -> list[dict]:
    """Each canary step: its weight, then the step's analysis (none where nothing can judge it). With the
    router, the walk starts with its weight at 0, and each setWeight (which sizes the canary's pods) is
    followed by the same weight on the router (which sends the traffic)."""
    k, router = deploy.kubernetes, routed(deploy)
    steps: list[dict] = [_router_weight(name, 0)] if router else []
    for s in deploy.steps:
        steps.append({"setWeight": int(round(s.weight))})
        if router:
            steps.append(_router_weight(name, s.weight))
        template = f"{name}-step" if s.weight < 100 else f"{name}-step-full" if has_full_gate else None
        if template is None:
            warnings.append(f"step {s.weight:g}%: no stable traffic left to compare with and no absolute check: "
                            "no step analysis (the guard keeps running)")
            continue
        steps.append({"analysis": {"templates": [{"templateName": template}],
                                   "args": [*ARG_VALUES, {"name": "min-requests", "value": str(s.min_requests)}]}})
        if k.traffic_routing == "replicas" and s.weight < 100 and not router:
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
    if k.traffic_routing == "nginx" and not routed(deploy):  # with the router, it splits and the Ingress fronts it
        canary["trafficRouting"] = {"nginx": {"stableIngress": name}}
    drain = math.ceil(deploy.router.admission.drain_timeout_s)
    key = UPSTREAM_KEY if routed(deploy) else API_KEY  # behind the router, only the router's key opens it
    container: dict[str, Any] = {
        "name": "kiln-serve", "image": k.image_ref, "command": ["kiln"],
        "args": ["serve", k.model_path, "--host", "0.0.0.0", "--port", str(k.port), "--drain-timeout", str(drain),
                 *(["--ttft-slo-ms", f"{k.ttft_slo_ms:g}"] if k.ttft_slo_ms else [])],
        # kiln serve refuses a non-loopback listener without a key: clients send 'Authorization: Bearer <key>'.
        "env": [{"name": "KILN_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret_name(name, k), "key": key}}}],
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
    """The arms' Services; the clients' `<name>` (the router with mirroring, else both arms' pods by count)
    or, with nginx, an Ingress (to the router, else to stable with Argo's trafficRouting)."""
    k, router = deploy.kubernetes, routed(deploy)

    def service(svc: str) -> dict:
        return {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": svc, "namespace": k.namespace, "labels": {"app": name}},
                "spec": {"selector": {"app": name},
                         "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}

    docs = [service(f"{name}-stable"), service(f"{name}-canary")]
    if router:
        docs.append(router_service(name, k))
    elif k.traffic_routing == "replicas":
        docs.append(service(name))  # clients; the split is the ratio of canary to stable pods
    if k.traffic_routing == "nginx":
        backend = name if router else f"{name}-stable"
        rule: dict[str, Any] = {"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
            "service": {"name": backend, "port": {"name": "http"}}}}]}}
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
    warnings: list[str] = [] if verify else [UNVERIFIED]
    templates = analysis_templates(name, policy, deploy, warnings)
    if routed(deploy):
        templates.append(router_weight_template(name, deploy))
    has_full = any(t["metadata"]["name"] == f"{name}-step-full" for t in templates)
    requires = required(name, deploy, verify)
    warnings += [r.line() for r in requires] + _notes(name, deploy)
    docs = [*templates, rollout(name, deploy, has_full, warnings, verify),
            *([router_deployment(name, deploy)] if routed(deploy) else []), *services(name, deploy),
            *autoscaler(name, deploy)]
    violations = validate_rollout(docs)
    if violations:  # Argo would put every such AnalysisRun in Error and abort the rollout
        raise BadInput("deploy: Argo Rollouts would reject the rendered analysis at run time "
                       "(its AnalysisRun validation); change the recipe fields named:",
                       recipe_problems(violations, policy, deploy))
    return Rendered(docs, warnings, requires)


UNVERIFIED = ("rendered without --model-version: the pods serve whatever engine the image holds, and nothing checks "
              "it against a signed verdict; render with --model-version VERSION to add the kiln-verify init container")


def required(name: str, deploy: DeployConfig, verify: tuple[str, str] | None) -> list[Required]:
    """The Secrets and ConfigMaps the pods read: the API keys, and with `verify` the tracking server's URI
    and the public key the verdicts are signed with."""
    k = deploy.kubernetes
    ns, secret = k.namespace, secret_name(name, k)
    if routed(deploy):
        keys = (API_KEY, UPSTREAM_KEY, ADMIN_KEY)
        why = (f"{API_KEY}: the clients' key(s) for the router (comma-separated: several tenants); {UPSTREAM_KEY}: "
               f"one key the router sends the engines, the only one they accept; {ADMIN_KEY}: the router's /admin, "
               "which the rollout's weight steps send")
    else:
        keys, why = (API_KEY,), "kiln serve's key(s) (comma-separated: several tenants)"
    out = [Required("secret", secret, keys, why, f"kubectl -n {ns} create secret generic {secret} "
                    + " ".join(f"--from-literal={key}=<key>" for key in keys))]
    if verify is not None:
        out += [Required("secret", f"{name}-tracking", ("uri",), "the tracking server's URI for the kiln-verify init "
                         "container", f"kubectl -n {ns} create secret generic {name}-tracking "
                         "--from-literal=uri=<MLFLOW_TRACKING_URI>"),
                Required("configmap", f"{name}-trusted-keys", ("kiln.pub",), "the public key your verdicts are "
                         "signed with", f"kubectl -n {ns} create configmap {name}-trusted-keys "
                         "--from-file=kiln.pub=<(kiln key show)")]
    return out


def _notes(name: str, deploy: DeployConfig) -> list[str]:
    """What else a cluster must provide: the image, an adapter for the HPA, the router's part."""
    k = deploy.kubernetes
    built = k.image_ref if not k.image_tag.startswith("sha256:") else f"{k.image}:<tag>"
    notes = [f"image {k.image_ref}: every pod runs it, so the cluster must pull it and find the engine at "
             f"{k.model_path} in it: build kiln's Dockerfile (docker build -t {built} . in kiln's checkout), then an "
             "image FROM it that copies the engine folder there, push that and name it in deploy.kubernetes.image "
             "and image_tag"]
    if k.autoscaler == "hpa":
        notes.append("hpa: needs an external-metrics adapter (e.g. prometheus-adapter) exposing "
                     f"{METRICS['waiting'].replace(':', '_')}")
    if routed(deploy) and k.traffic_routing == "nginx":
        notes.append("traffic_routing nginx: with the router in front (mirroring), the Ingress routes to Service "
                     f"{name} (the router), which splits by exact weights; Argo's nginx trafficRouting is not used")
    return notes


@TARGETS.register("kubernetes", KubernetesConfig)
class KubernetesTarget(DeployTarget):
    """The canary walked in a cluster by Argo Rollouts. Entered, it checks that kubectl reaches a cluster
    holding what the rendered manifests need (KilnError naming each missing piece otherwise); `walk` applies
    them and follows the Rollout until Argo promotes it, aborts it or pauses it undecided, and settles the
    journal accordingly. Argo's controller walks it, not kiln's: the step calls name the kubectl command."""

    name = "kubernetes"

    def __init__(self, name: str, policy: GateSection, deploy: DeployConfig, verify: tuple[str, str] | None = None,
                 journal: CanaryJournal | None = None, log: Any = print, kubectl: Kubectl | None = None,
                 sleep: Any = time.sleep, clock: Any = time.monotonic):
        self.app, self.policy, self.deploy, self.verify = name, policy, deploy, verify
        self.journal, self.log, self.kubectl = journal, log, kubectl or Kubectl()
        self.sleep, self.clock = sleep, clock

    @classmethod
    def open(cls, request: DeployRequest) -> KubernetesTarget:
        """The run's registered version rolled out: each pod verifies its engine against that version's verdict."""
        return cls(request.name, request.policy, request.deploy, request.version, request.journal, request.log)

    def render(self) -> Rendered:
        return render(self.app, self.policy, self.deploy, self.verify)

    def __enter__(self) -> KubernetesTarget:
        self.rendered = self.render()
        k = self.deploy.kubernetes
        crds = ["rollouts.argoproj.io", "analysistemplates.argoproj.io"]
        crds += ["scaledobjects.keda.sh"] if k.autoscaler == "keda" else []
        missing = self.kubectl.missing(k.namespace, crds, self.rendered.requires)
        if missing:
            raise KilnError("deploy.target kubernetes: `kiln deploy canary` applies the manifests with kubectl and "
                            "follows Argo Rollouts' walk in the cluster, which needs what is missing here:\n  - "
                            + "\n  - ".join(missing) + "\nOr write them with `kiln deploy render` and apply them "
                            "where a cluster is reachable.")
        return self

    def walk(self, controller: Any) -> CanaryResult:
        """Apply, then follow Argo's walk (kiln's `controller` is not used: Argo's judges the steps)."""
        from kiln.deploy.journal import CanaryJournal, CanaryResult

        journal = self.journal or CanaryJournal()
        journal.resolve()
        run_id = journal.start(self.deploy, self.policy)
        k = self.deploy.kubernetes
        applied = self.kubectl.apply(self.rendered.yaml())
        generation = next(d["metadata"]["generation"] for d in applied if d.get("kind") == "Rollout")
        self.log(f"kiln deploy: applied {len(applied)} objects in namespace {k.namespace}; Argo Rollouts walks "
                 f"rollout {self.app} (revision generation {generation})")
        status, code, reason = self._follow(generation)
        if status == "degraded":  # stalled (pods never ready, the verify init container refusing...): end it
            self.kubectl.abort(k.namespace, self.app)
            status, reason = "rolled_back", reason + "; kiln aborted it (all traffic back on stable)"
        result = CanaryResult(status, code, reason, model=journal.model, version=journal.version, run_id=run_id)
        journal.settle(status)
        journal.finish(result)
        self.log(f"canary: {status}: {reason}")
        return result

    def _follow(self, generation: int) -> tuple[str, ExitCode, str]:
        """Poll the Rollout until `outcome` says how it ended, logging each step Argo reaches."""
        k, steps = self.deploy.kubernetes, self.rendered_steps()
        budget = STARTUP_S + sum(s.max_duration_s for s in self.deploy.steps) \
            + (duration_s(k.query_window) * len(self.deploy.steps) if routed(self.deploy) else 0)
        deadline, seen, errors = self.clock() + budget, None, 0
        while True:
            try:
                rollout = self.kubectl.rollout(k.namespace, self.app)
                errors = 0
            except KilnError as e:  # the API server out of reach for a moment; Argo goes on meanwhile
                errors += 1
                if errors >= FOLLOW_ERRORS:
                    return "held", ExitCode.INTERNAL_ERROR, (
                        f"kiln lost track of the walk ({e}); it goes on in the cluster: kubectl argo rollouts get "
                        f"rollout {self.app} -n {k.namespace} --watch")
                self.sleep(self.deploy.poll_s)
                continue
            ended = outcome(rollout, generation)
            if ended is not None:
                return ended
            index = (rollout.get("status") or {}).get("currentStepIndex")
            if index != seen and index is not None and index < len(steps):
                seen = index
                self.log(f"canary: rollout step {index + 1}/{len(steps)}: {_describe(steps[index])}")
            if self.clock() > deadline:
                return "held", ExitCode.GATE_INCONCLUSIVE, (
                    f"Argo has not ended the walk within {budget:.0f} s; it goes on in "
                    f"the cluster: kubectl argo rollouts get rollout {self.app} -n {k.namespace} --watch")
            self.sleep(self.deploy.poll_s)

    def rendered_steps(self) -> list[dict]:
        rollout = next(d for d in self.rendered.documents if d["kind"] == "Rollout")
        return rollout["spec"]["strategy"]["canary"]["steps"]

    def _in_cluster(self, what: str, command: str) -> KilnError:
        return KilnError(f"kubernetes target: {what} is done in the cluster by Argo Rollouts, not by kiln. "
                         f"Apply the rendered manifests (kubectl apply -f) and use `{command}`.")

    def set_traffic(self, weight: float) -> None:
        raise self._in_cluster("setting the canary weight", f"kubectl argo rollouts set weight {self.app} {weight:g}")

    def observe(self, cursor: tuple[int, int] = (0, 0)) -> Observations:
        raise KilnError("kubernetes target: observe() needs per-request observations, which Prometheus does not "
                        "keep (only histograms). In the cluster the rendered AnalysisTemplates judge the canary; "
                        f"query {self.deploy.kubernetes.prometheus_url} yourself, or the rendered router's "
                        "/admin/observations (with mirroring) with its admin key.")

    def promote(self) -> None:
        raise self._in_cluster("promotion", f"kubectl argo rollouts promote {self.app}")

    def rollback(self) -> None:
        raise self._in_cluster("rollback", f"kubectl argo rollouts abort {self.app}")


def _describe(step: dict) -> str:
    if "setWeight" in step:
        return f"{step['setWeight']}% of the pods on the canary"
    templates = ", ".join(t["templateName"] for t in step["analysis"]["templates"])
    args = {a["name"]: a.get("value") for a in step["analysis"].get("args", [])}
    return f"the router sends {args['weight']}% to the canary" if templates.endswith("-router-weight") \
        else f"analysis {templates}"
