"""Configuration of the deploy stage: the router, its admission control, the canary walk, the
Kubernetes rendering. One validated object per concern, `extra="forbid"` everywhere.

`DeployConfig` is the recipe's `deploy:` section (pipeline/recipe/schema.py `Recipe.deploy`); its
`target` names a registered deploy target (targets.py). Secrets (API keys) are never config fields:
they come from the environment, an argument or (in a cluster) a Secret, so a dumped config never
carries one.
"""

from __future__ import annotations

import importlib.metadata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiln.deploy.targets import TARGETS
from kiln.engine.serve.admission import AdmissionConfig
from kiln.core.registry import did_you_mean


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RouterOptions(Section):
    """How the router splits and watches traffic (the part that belongs in a recipe)."""

    affinity: Literal["session", "prefix", "random"] = Field(
        "session", description="session: X-Session-Id header or the 'user' field, else the prompt prefix; "
                               "prefix: hash of the prompt prefix; random: per request")
    session_header: str = "X-Session-Id"
    prefix_chars: int = Field(256, ge=1, description="characters of the prompt that key prefix affinity")
    vnodes: int = Field(4096, ge=16, description="virtual nodes per arm on the hash ring")
    balance: Literal["prefix", "round-robin"] = Field(
        "prefix", description="how an arm's replicas (its URL a comma-separated list) share its requests: prefix: "
                              "by a hash of the prompt prefix, so each replica's prompt cache sees prefixes it holds; "
                              "round-robin: in turn (for engines without a prompt cache)")
    balance_bound: float = Field(1.25, ge=1, description="prefix balance: a replica past this times the mean requests "
                                                         "in flight passes a request on to the next on the ring")
    mirror_fraction: float = Field(0.0, ge=0, le=1, description="share of greedy requests also sent to the other arm")
    connect_timeout_s: float = Field(5, gt=0)
    read_timeout_s: float = Field(300, gt=0, description="longest silence from a backend mid-request")
    window: int = Field(200_000, ge=100, description="per-request observations kept for the controller")
    admission: AdmissionConfig = AdmissionConfig()


class RouterConfig(RouterOptions):
    """A running router: options plus where it listens and what it fronts."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535, description="0 = a free port")
    stable_url: str
    canary_url: str | None = None
    weight: float = Field(0.0, ge=0, le=100, description="percent of traffic sent to the canary")

    @model_validator(mode="after")
    def _urls(self) -> RouterConfig:
        for name in ("stable_url", "canary_url"):
            value = getattr(self, name)
            if value is not None and not all(u.strip().startswith(("http://", "https://")) for u in value.split(",")):
                raise ValueError(f"{name}: give http(s) URLs, several (replicas of one engine) comma-separated; "
                                 f"got {value!r}")
        return self


class CanaryStep(Section):
    weight: float = Field(gt=0, le=100, description="percent of traffic on the canary during this step")
    min_requests: int = Field(50, ge=1, description="canary requests this step must see before it can pass")
    max_duration_s: float = Field(300, gt=0, description="after this, an undecided step holds or rolls back")


def kiln_version() -> str:
    """The installed kiln's version: the tag of the image its Dockerfile builds, unless a recipe says otherwise."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "dev"


class KubernetesConfig(Section):
    """What `kiln deploy render` writes: an Argo Rollout, its AnalysisTemplates, Services, autoscaler,
    and with mirroring (deploy.router.mirror_fraction > 0) the router in front of both arms."""

    namespace: str = "default"
    image: str = Field("kiln", description="repository of the image that runs `kiln serve` (and the router): the one "
                                           "kiln's Dockerfile builds, or one FROM it holding the engine at model_path")
    image_tag: str = Field(default_factory=kiln_version, min_length=1,
                           description="its tag (default: kiln's version, as `docker build -t kiln:<version> .` "
                                       "tags it), or a digest 'sha256:...'")
    model_path: str = Field("/models/engine", description="engine folder inside the container")
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(4, ge=1)
    gpus: int = Field(0, ge=0, description="nvidia.com/gpu per pod")
    traffic_routing: Literal["replicas", "nginx"] = Field(
        "replicas", description="replicas: split by pod counts (no mesh needed); nginx: exact weights via ingress. "
                                "With mirroring the router splits by exact weights and the Ingress fronts it")
    ingress_host: str | None = None
    api_key_secret: str | None = Field(None, description="Secret holding the clients' API key(s) under 'api-key' "
                                                         "(with mirroring also the router's 'upstream-key' and "
                                                         "'admin-key'); default '<name>-api-key'")
    ttft_slo_ms: float | None = Field(None, gt=0, description="TTFT objective passed to `kiln serve --ttft-slo-ms`: "
                                      "its queue admits what the objective leaves (None: within 1.5x of at-capacity TTFT)")
    pre_stop_s: int = Field(5, ge=0, description="preStop wait before SIGTERM, while endpoints stop sending traffic")
    prometheus_url: str = "http://prometheus.monitoring.svc.cluster.local:9090"
    query_window: str = Field("5m", pattern=r"^[0-9]+[smh]$")
    analysis_interval: str = Field("1m", pattern=r"^[0-9]+[smh]$")
    failure_limit: int = Field(2, ge=0, description="failed measurements tolerated by the background guard")
    consecutive_successes: int = Field(3, ge=1, description="successful measurements in a row that pass a step")
    latency_statistic: Literal["mean", "p50", "p90", "p95", "p99"] = "mean"
    hash_label: str = Field("rollouts_pod_template_hash", description="Prometheus label carrying the pod-template hash")
    autoscaler: Literal["keda", "hpa", "none"] = "keda"
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(16, ge=1)
    queue_per_replica: float = Field(8, gt=0, description="waiting requests per pod that trigger a scale-up")

    @field_validator("image")
    @classmethod
    def _repository(cls, image: str) -> str:
        """A repository alone: a tag or digest here would be doubled by image_tag."""
        head, _, last = image.split("@", 1)[0].rpartition("/")
        if "@" in image or ":" in last:
            repository = (head + "/" if head else "") + last.split(":", 1)[0]
            raise ValueError(f"give the image's repository alone ({repository}); its tag or digest goes in "
                             "deploy.kubernetes.image_tag")
        return image

    @property
    def image_ref(self) -> str:
        """The image a pod pulls: repository:tag, or repository@sha256:... for a digest."""
        return f"{self.image}{'@' if self.image_tag.startswith('sha256:') else ':'}{self.image_tag}"


class DeployConfig(Section):
    """The recipe's `deploy:` section: where the canary walks (`target`), its steps, and how each target runs."""

    target: str = Field("local", description="where the canary walks: a registered deploy target (deploy/targets.py): "
                                              "local (both arms and the router on this machine) or kubernetes (a "
                                              "cluster, under Argo Rollouts)",
                        json_schema_extra=lambda schema: schema.update(enum=TARGETS.names()))  # as registered now
    steps: list[CanaryStep] = Field(default_factory=lambda: [CanaryStep(weight=w) for w in (5, 25, 50, 100)],
                                    min_length=1)
    on_inconclusive: Literal["hold", "rollback"] = "rollback"
    poll_s: float = Field(2.0, gt=0, description="seconds between two looks at the live data")
    min_per_arm: int = Field(20, ge=2, description="observations per arm before a check may decide")
    effect_scale: float = Field(0.1, gt=0, description="effect (relative) the sequential test is tuned to detect fastest")
    router: RouterOptions = RouterOptions()
    kubernetes: KubernetesConfig = KubernetesConfig()

    @field_validator("target")
    @classmethod
    def _registered(cls, target: str) -> str:
        if target not in TARGETS.names():
            raise ValueError(f"unknown deploy target '{target}'.{did_you_mean(target, TARGETS.names())}")
        return target

    @model_validator(mode="after")
    def _increasing(self) -> DeployConfig:
        weights = [s.weight for s in self.steps]
        if any(b <= a for a, b in zip(weights, weights[1:], strict=False)):
            raise ValueError(f"steps: weights must increase step by step, got {weights}")
        return self
