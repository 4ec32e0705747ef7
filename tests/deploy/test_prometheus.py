"""The rendered analysis against the real other side: Debian's Prometheus scraping two real
`kiln serve` arms (tiny model), every query of the AnalysisTemplates and the KEDA trigger
evaluated through /api/v1/query with the args substituted as Argo does. None may be empty."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from kiln.deploy.argo_rules import substitute
from kiln.deploy.config import CanaryStep, DeployConfig, KubernetesConfig
from kiln.deploy.kubernetes import render
from kiln.core.gate.policy import GateSection

KEY = "prom-test-key"
ADMIN_KEY = "prom-admin-key"  # /admin always needs a key; the routers here have no client key
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 3.0},
    {"kind": "performance", "metric": "ttft_ms", "max": 60000},
    {"kind": "performance", "metric": "decode_tok_s", "min_ratio": 0.3},
    {"kind": "performance", "metric": "tpot_ms", "max": 60000},
    {"kind": "error_rate", "max": 0.01},
]})
ARGS = {"canary-hash": "canary", "stable-hash": "stable", "min-requests": "10"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None = None, timeout: float = 5) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _complete(url: str, prompt: str) -> int:
    body = json.dumps({"prompt": prompt, "max_tokens": 6, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _prometheus(tmp_path: Path, arms: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Debian's prometheus scraping each arm (url) every second, labelled as the Rollout's pods are."""
    return _start_prometheus(tmp_path, [{"job_name": "kiln", "static_configs": [
        {"targets": [url.removeprefix("http://")], "labels": {"namespace": "default", "app": "smol",
                                                              "rollouts_pod_template_hash": name}}
        for name, url in arms.items()]}], len(arms))


def _start_prometheus(tmp_path: Path, jobs: list[dict], targets: int) -> tuple[subprocess.Popen, str]:
    """Prometheus on `jobs`, every second, ready once each of its `targets` was scraped once
    (before any traffic: increase() counts from there)."""
    if not Path(PROMETHEUS).exists():
        pytest.fail("needs Debian's prometheus: apt-get install -y prometheus (make system-deps)")
    port = _free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": jobs}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: _get(url + "/-/ready")[0] == 200, "prometheus ready", 60)

    def scraped() -> bool:
        body = json.loads(_get(url + "/api/v1/query?query=" + urllib.parse.quote("up == 1"))[1])
        return len(body["data"]["result"]) == targets
    _wait(scraped, "a first scrape of every target", 30)
    return proc, url


def _evaluate(prom: str, docs: list[dict], args: dict[str, str]) -> dict[str, tuple[float | None, dict]]:
    """Every query of the rendered templates and the KEDA trigger, args substituted as Argo does:
    label -> (first value or None when empty, the resolved metric)."""
    out = {}
    for label, query, metric in _queries(docs, args):
        status, body = _get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": query}))
        answer = json.loads(body)
        assert status == 200 and answer["status"] == "success", (label, query, answer)
        result = answer["data"]["result"]
        out[label] = (float(result[0]["value"][1]) if result else None, metric)
    return out


def _holds(condition: str, value: float | None) -> bool:
    """Argo's `len(result) > 0 && result[0] <= 1.1` for one value."""
    match = re.fullmatch(r"len\(result\) > 0 && result\[0\] (<=|>=|<|>) (\S+)", condition)
    assert match, condition
    if value is None:
        return False
    bound = float(match.group(2))
    return {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[match.group(1)]


def _queries(docs: list[dict], args: dict[str, str] = ARGS) -> list[tuple[str, str, dict]]:
    out = []
    for d in docs:
        if d["kind"] == "AnalysisTemplate":
            for m in d["spec"]["metrics"]:
                if "prometheus" not in m["provider"]:  # the router's weight step (a web call, test_router_manifests.py)
                    continue
                resolved, missing = substitute(m, args)
                assert not missing, missing
                out.append((f"{d['metadata']['name']}/{m['name']}", resolved["provider"]["prometheus"]["query"], resolved))
        elif d["kind"] == "ScaledObject":
            for t in d["spec"]["triggers"]:
                out.append((f"{d['metadata']['name']}/keda", t["metadata"]["query"], {}))
    return out


@pytest.mark.timeout(300)
def test_every_rendered_query_returns_data_from_kiln_serve(tiny_model_dir, tmp_path):
    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    ports = {"stable": _free_port(), "canary": _free_port()}
    arms, procs = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}, []
    try:
        for name, port in ports.items():
            procs.append(subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "serve", str(engine_dir), "--port",
                                           str(port), "--request-log", "off"], env={**os.environ, "KILN_API_KEY": KEY},
                                          stdout=subprocess.DEVNULL))
        for url in arms.values():
            _wait(lambda u=url: _get(u + "/health")[0] == 200, f"{url}/health", 180)
        prometheus, prom = _prometheus(tmp_path, arms)
        procs.append(prometheus)
        assert _get(arms["stable"] + "/metrics")[0] == 200  # scraped without a key, as a pod annotation scrape is
        for i in range(15):  # bounded traffic on both arms
            for url in arms.values():
                assert _complete(url, f"request {i}") == 200
        time.sleep(3)  # at least two scrapes after the traffic: rate() needs two samples

        deploy = DeployConfig(steps=[CanaryStep(weight=50, min_requests=10)],
                              kubernetes=KubernetesConfig(query_window="1m", analysis_interval="1m"))
        results = _evaluate(prom, render("smol", POLICY, deploy).documents, ARGS)
        empty = [label for label, (value, _) in results.items() if value is None]
        values = {label: value for label, (value, _) in results.items()}
        assert all(math.isfinite(v) for v in values.values() if v is not None), values
        assert not empty, f"queries with no data: {empty}"
        assert values["smol-step/error-rate"] == 0.0  # every request above succeeded
        print(json.dumps(values, indent=1))
    finally:
        _stop(procs)


VERDICT_POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 1.15},
    {"kind": "performance", "metric": "tpot_ms", "max_ratio": 1.15},
    {"kind": "error_rate", "max": 0.05},
]})


@pytest.mark.timeout(180)
def test_step_verdicts_on_fake_canaries_that_export_kiln_serves_names(tmp_path):
    """The same rendered conditions on fake-engine canaries (exactly kiln serve's names): a same-speed
    canary passes every check, a 30% slower one fails the latency ratios, one answering 10% with
    HTTP 500 fails the error rate (a fixed seed: 10 of its 100 requests fail every run)."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.engine.serve.fake import FakeServer
    from tests.deploy.fakes import fake

    # seed 4: exactly 10 of the first 100 requests draw an injected HTTP 500
    canaries = {"good": fake(), "slow": fake(slowdown=1.3), "errors": fake(error_rate=0.1, seed=4)}
    servers = {"stable": FakeServer(fake()), **{name: FakeServer(cfg) for name, cfg in canaries.items()}}
    prometheus = None
    try:
        arms = {name: server.__enter__().url for name, server in servers.items()}
        prometheus, prom = _prometheus(tmp_path, arms)

        def traffic(url: str) -> list[int]:
            return [_complete(url, f"request {i}") for i in range(50)]
        with ThreadPoolExecutor(2 * len(arms)) as pool:  # two clients per arm, 100 requests each
            sent = {name: [pool.submit(traffic, url) for _ in range(2)] for name, url in arms.items()}
            statuses = {name: [s for f in futures for s in f.result()] for name, futures in sent.items()}
        assert statuses["errors"].count(500) == 10 and set(statuses["good"]) == {200}
        time.sleep(3)
        deploy = DeployConfig(steps=[CanaryStep(weight=50, min_requests=20)],
                              kubernetes=KubernetesConfig(query_window="1m", analysis_interval="1m"))
        docs = render("smol", VERDICT_POLICY, deploy).documents
        failing = {}
        for canary in canaries:
            results = _evaluate(prom, docs, {"canary-hash": canary, "stable-hash": "stable", "min-requests": "20"})
            assert all(value is not None for value, _ in results.values()), (canary, results)
            step = {label.split("/")[1]: (v, m) for label, (v, m) in results.items() if label.startswith("smol-step/")}
            failing[canary] = sorted(name for name, (v, m) in step.items() if not _holds(m["successCondition"], v))
            guard = {label.split("/")[1]: (v, m) for label, (v, m) in results.items() if label.startswith("smol-guard/")}
            assert failing[canary] == sorted(n for n, (v, m) in guard.items() if _holds(m["failureCondition"], v))
        assert failing == {"good": [], "slow": ["performance-tpot-ms-max-ratio", "performance-ttft-ms-max-ratio"],
                           "errors": ["error-rate"]}
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        for server in servers.values():
            server.__exit__(None, None, None)


AGREEMENT_POLICY = GateSection.model_validate({"checks": [
    {"kind": "performance", "metric": "ttft_ms", "max_ratio": 3.0},  # lenient: both arms run one engine
    {"kind": "performance", "metric": "tpot_ms", "max_ratio": 3.0},
    {"kind": "error_rate", "max": 0.05},
    # The broken engine corrupts only the steps it shares with another request, so its agreement moves
    # with how the mirrors overlap: 0.13 and 0.22 on a quiet machine, 0.31 under CI's second worker
    # (past the demo's 0.3). The identical canary scored 1.0 every time: 0.6 tells them apart.
    {"kind": "agreement", "metric": "served_prefix", "min": 0.6},
]})


def _greedy(url: str, i: int) -> int:
    body = json.dumps({"prompt": f"Once upon a time, in story number {i}, there", "max_tokens": 12,
                       "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        return r.status


@pytest.mark.timeout(600)
def test_a_canary_that_corrupts_batched_tokens_is_rolled_back_on_quality_alone(tiny_model_dir, tmp_path):
    """Two real `kiln serve` canaries beside one stable, each behind its own real `kiln route`
    mirroring every greedy prompt: one on the engine that corrupts batched tokens (fast, no errors,
    wrong text), one identical to stable. Prometheus scrapes all five; the rendered step gate fails
    the corrupting canary on served_prefix alone (latency and errors pass) and passes the other."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.deploy.config import RouterOptions
    from kiln.engine.cache import build_engine
    from kiln.engine.hf_torch import TorchEngineConfig

    engine_dir = build_engine(TorchEngineConfig(threads=1), tiny_model_dir, "sha", tmp_path)
    serve = {"stable": "kiln.pipeline", "good": "kiln.pipeline", "broken": "tests.deploy.broken_serve"}
    ports = {name: _free_port() for name in [*serve, "route-good", "route-broken"]}
    url = {name: f"http://127.0.0.1:{p}" for name, p in ports.items()}
    procs, prometheus = [], None
    repo = Path(__file__).parents[2]
    try:
        for name, module in serve.items():
            procs.append(subprocess.Popen([sys.executable, "-m", module, "serve", str(engine_dir), "--port",
                                           str(ports[name]), "--request-log", "off", "--queue-wait", "off", "--max-queue", "256"], cwd=repo,
                                          env={**os.environ, "KILN_API_KEY": KEY}, stdout=subprocess.DEVNULL))
        router_env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"} | {"KILN_UPSTREAM_API_KEY": KEY,
                                                                                     "KILN_ADMIN_KEY": ADMIN_KEY}
        for canary in ("good", "broken"):
            procs.append(subprocess.Popen([sys.executable, "-m", "kiln.pipeline", "route", "--stable", url["stable"],
                                           "--canary", url[canary], "--weight", "50", "--mirror-fraction", "1",
                                           "--port", str(ports[f"route-{canary}"])], cwd=repo, env=router_env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for u in url.values():
            _wait(lambda u=u: _get(u + "/health")[0] == 200, f"{u}/health", 180)
        # one namespace per walk; stable's pods are in both, as a Rollout's stable is
        targets = {"stable": [("good", "stable"), ("broken", "stable")], "good": [("good", "canary")],
                   "broken": [("broken", "canary")], "route-good": [("good", None)], "route-broken": [("broken", None)]}
        prometheus, prom = _prometheus_labelled(tmp_path, {url[n]: t for n, t in targets.items()})
        n = 32
        with ThreadPoolExecutor(12) as pool:  # 12 at once: the canaries batch, which breaks the broken one
            statuses = list(pool.map(lambda i: _greedy(url[f"route-{'good' if i % 2 else 'broken'}"], i // 2),
                                     range(2 * n)))
        assert set(statuses) == {200}
        for canary in ("good", "broken"):  # every mirror compared (or dropped) before Prometheus looks
            _wait(lambda c=canary: len(json.loads(_get(url[f"route-{c}"] + "/admin/observations", ADMIN_KEY)[1])
                                       ["comparisons"])
                  + _dropped(url[f"route-{c}"]) >= n, f"route-{canary} mirrors", 120)
        time.sleep(3)  # two scrapes after the traffic
        failing = {}
        for canary in ("good", "broken"):
            deploy = DeployConfig(steps=[CanaryStep(weight=50, min_requests=8)], router=RouterOptions(mirror_fraction=1.0),
                                  kubernetes=KubernetesConfig(namespace=canary, query_window="1m", analysis_interval="1m"))
            results = _evaluate(prom, render("smol", AGREEMENT_POLICY, deploy).documents,
                                {"canary-hash": "canary", "stable-hash": "stable", "min-requests": "8"})
            step = {label.split("/")[1]: (v, m) for label, (v, m) in results.items() if label.startswith("smol-step/")}
            assert all(v is not None for v, _ in step.values()), (canary, step)
            failing[canary] = sorted(name for name, (v, m) in step.items() if not _holds(m["successCondition"], v))
            print(canary, {name: v for name, (v, _) in step.items()})
        assert failing == {"good": [], "broken": ["agreement-served-prefix"]}
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)
        _stop(procs)


def _stop(procs: list) -> None:
    """Every process asked to stop, then waited for (killed past 40 s)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=40)
        except subprocess.TimeoutExpired:
            p.kill()


def _dropped(router: str) -> int:
    from kiln.engine.serve import metric_names as names

    text = _get(router + "/metrics")[1].decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(names.total(names.ROUTER_MIRROR_DROPPED) + "{")))


def _prometheus_labelled(tmp_path: Path, targets: dict[str, list[tuple[str, str | None]]]) -> tuple[subprocess.Popen, str]:
    """Prometheus scraping each url once per (namespace, pod-template hash, or None for the router: its pods
    carry the rendered router Deployment's labels, app=smol-router, and no hash)."""
    from kiln.deploy.analysis_templates import router_app

    static = [{"targets": [u.removeprefix("http://")],
               "labels": {"namespace": ns, **({"app": "smol", "rollouts_pod_template_hash": h} if h else
                                              {"app": router_app("smol")})}}
              for u, labels in targets.items() for ns, h in labels]
    return _start_prometheus(tmp_path, [{"job_name": f"kiln-{i}", "static_configs": [s]} for i, s in enumerate(static)],
                             len(static))
