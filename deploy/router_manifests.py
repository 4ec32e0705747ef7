"""The router in a cluster: a Deployment `<name>-router` and the client Service `<name>` in front of it.

Rendered with mirroring (deploy.router.mirror_fraction > 0): the router (router.py) mirrors greedy
prompts to both arms and scores them, the signal the agreement checks' queries read
(analysis_templates.py); without it those checks have nothing to read and every step gate with one
would run out of measurements and roll back. It runs what `RouterProcess` runs locally, `python -m
kiln.deploy.router_process '<RouterConfig JSON>'`: the recipe's router options, listening on 0.0.0.0
(said here, in its config: the router's own default is loopback) in front of the arms' Services
`<name>-stable` and `<name>-canary`, at weight 0 until the rollout's steps set it (/admin/weight).

Its three keys come from the API-key Secret through the environment (never a literal, never the
command line): `api-key`, what clients send it; `upstream-key`, the one key it sends the engines (the
only one they accept behind it); `admin-key`, what /admin needs (the rollout's weight steps send it).

One replica: the weight and the walk's observations live in the router's memory, and two routers
would each hold their own. If it restarts mid-walk it comes back at weight 0 with stable only serving,
until the next step sets the weight again (a step gate without enough canary requests then ends
undecided, as deploy.on_inconclusive says).
"""

from __future__ import annotations

import math
from typing import Any

from kiln.deploy.analysis_templates import API_KEY, ADMIN_KEY, ROUTER_PORT, UPSTREAM_KEY, router_app, secret_name
from kiln.deploy.config import DeployConfig, KubernetesConfig, RouterConfig
from kiln.deploy.router_process import ADMIN_KEY_ENV, KEY_ENV, UPSTREAM_KEY_ENV

GRACE_MARGIN_S = 10  # the router exits within its drain timeout; the rest is slack


def router_config(name: str, deploy: DeployConfig) -> RouterConfig:
    """The recipe's router options, listening beyond loopback, in front of the two arms' Services."""
    return RouterConfig(**deploy.router.model_dump(), host="0.0.0.0", port=ROUTER_PORT,
                        stable_url=f"http://{name}-stable", canary_url=f"http://{name}-canary", weight=0)


def router_deployment(name: str, deploy: DeployConfig) -> dict[str, Any]:
    k, app = deploy.kubernetes, router_app(name)
    secret = secret_name(name, k)

    def key(env: str, key: str) -> dict[str, Any]:
        return {"name": env, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}

    drain = math.ceil(deploy.router.admission.drain_timeout_s)
    health = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 2}
    container = {"name": "kiln-router", "image": k.image_ref,
                 "command": ["python", "-m", "kiln.deploy.router_process"],
                 "args": [router_config(name, deploy).model_dump_json()],
                 "env": [key(KEY_ENV, API_KEY), key(UPSTREAM_KEY_ENV, UPSTREAM_KEY), key(ADMIN_KEY_ENV, ADMIN_KEY)],
                 "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
                 "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(k.pre_stop_s)]}}},
                 "readinessProbe": health}
    labels = {"app": app}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": app, "namespace": k.namespace, "labels": {**labels, "app.kubernetes.io/part-of": name}},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels, "annotations": {
                         "prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                         "prometheus.io/path": "/metrics"}},
                         "spec": {"terminationGracePeriodSeconds": k.pre_stop_s + drain + GRACE_MARGIN_S,
                                  "containers": [container]}}}}


def router_service(name: str, k: KubernetesConfig) -> dict[str, Any]:
    """`<name>`, the clients' entry point (and the rollout's, for /admin/weight), to the router's pods."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": k.namespace, "labels": {"app": name}},
            "spec": {"selector": {"app": router_app(name)},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]}}
