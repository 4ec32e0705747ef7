"""The rendered router Deployment, run as a kubelet would run its container, on this machine: its command
and arguments as rendered (the interpreter aside), its environment filled from a Secret holding the three
keys, in front of two fake engines that accept only the upstream key. Then what the cluster does to it:
the readiness probe, a client with and without its key, Prometheus's scrape, and each rollout step's
weight call made as Argo's web provider makes it (method, headers, body, jsonPath, successCondition),
with the admin key and with a wrong one; SIGTERM ends it within its grace period."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from kiln.deploy.argo_rules import substitute
from kiln.deploy.config import CanaryStep, DeployConfig, RouterConfig, RouterOptions
from kiln.deploy.kubernetes import render
from kiln.deploy.router_process import READY
from kiln.engine.serve import metric_names as names
from kiln.engine.serve.fake import FakeServer
from kiln.core.gate.policy import GateSection
from tests.deploy.fakes import fake

SECRET = {"api-key": "client-key-1,client-key-2", "upstream-key": "engines-key", "admin-key": "rollout-admin-key"}
POLICY = GateSection.model_validate({"checks": [{"kind": "error_rate", "max": 0.01},
                                                {"kind": "agreement", "metric": "served_prefix", "min": 0.6}]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _web_metric(metric: dict, router: str, args: dict[str, str]) -> tuple[int, bool | None]:
    """Argo's web provider on one metric: substitute the args, send the request to the router (the rendered
    URL's path), read `jsonPath` from the answer and evaluate `successCondition`. (status, condition or None)."""
    resolved, missing = substitute(metric, args)
    assert not missing, missing
    web = resolved["provider"]["web"]
    status, body = _call(web["method"], router + urlsplit(web["url"]).path, web["body"].encode(),
                         {h["key"]: h["value"] for h in web["headers"]})
    if status != 200:
        return status, None  # an Error measurement for Argo
    assert web["jsonPath"] == "{$.weight}"
    result = json.loads(body)["weight"]
    condition = re.fullmatch(r"result == (\S+)", resolved["successCondition"])
    assert condition, resolved["successCondition"]
    return status, result == float(condition.group(1))


@pytest.mark.timeout(180)
def test_the_rendered_router_runs_as_its_deployment_says():
    deploy = DeployConfig(steps=[CanaryStep(weight=25), CanaryStep(weight=100)],
                          router=RouterOptions(mirror_fraction=0.5))
    docs = render("smol", POLICY, deploy).documents
    assert not any(v in json.dumps(docs) for v in SECRET.values())  # no key is written into a manifest
    router = next(d for d in docs if d["kind"] == "Deployment")
    [container] = router["spec"]["template"]["spec"]["containers"]
    config = RouterConfig.model_validate_json(container["args"][0])
    assert config.host == "0.0.0.0"  # the manifest says so; the router's own default is loopback
    port = _free_port()
    env = {e["name"]: SECRET[e["valueFrom"]["secretKeyRef"]["key"]] for e in container["env"]}
    with FakeServer(fake(), api_key=SECRET["upstream-key"]) as stable, \
            FakeServer(fake(), api_key=SECRET["upstream-key"]) as canary:
        # what differs from the pod: the interpreter's path, a free port, and the arms' Services' addresses
        local = config.model_copy(update={"port": port, "stable_url": stable.url, "canary_url": canary.url})
        command = [sys.executable if container["command"][0] == "python" else container["command"][0],
                   *container["command"][1:], local.model_dump_json()]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={"PATH": "/usr/bin:/bin", **env})
        try:
            line = proc.stdout.readline()
            assert line.startswith(READY), line
            _exercise(f"http://127.0.0.1:{port}", router, docs)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert time.monotonic() - started < router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        finally:
            if proc.poll() is None:
                proc.kill()


def _exercise(url: str, router: dict, docs: list[dict]) -> None:
    pod = router["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert _call("GET", url + container["readinessProbe"]["httpGet"]["path"])[0] == 200
    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
    json_type = {"Content-Type": "application/json"}
    assert _call("POST", url + "/v1/completions", body, json_type)[0] == 401
    for client in SECRET["api-key"].split(","):  # several tenants; the engines see only the upstream key
        assert _call("POST", url + "/v1/completions", body, {**json_type, "Authorization": f"Bearer {client}"})[0] == 200
    status, metrics = _call("GET", url + pod["metadata"]["annotations"]["prometheus.io/path"])
    assert status == 200 and names.ROUTER_REQUESTS.encode() in metrics
    template = next(d for d in docs if d["metadata"]["name"] == "smol-router-weight")
    [metric] = template["spec"]["metrics"]
    steps = next(d for d in docs if d["kind"] == "Rollout")["spec"]["strategy"]["canary"]["steps"]
    weights = [a["value"] for s in steps if "analysis" in s for a in s["analysis"]["args"] if a["name"] == "weight"]
    assert weights == ["0", "25", "100"]
    for weight in weights:  # each rollout step's call, with the admin key Argo reads from the Secret
        assert _web_metric(metric, url, {"weight": weight, "admin-key": SECRET["admin-key"]}) == (200, True)
        state = json.loads(_call("GET", url + "/admin/state", headers={
            "Authorization": f"Bearer {SECRET['admin-key']}"})[1])
        assert state["weight"] == float(weight)
    # a client's key does not move traffic: Argo would count an Error and, past its limit, abort
    assert _web_metric(metric, url, {"weight": "50", "admin-key": "client-key-1"})[0] == 401
