"""An arm of several replicas: the ring that places prompt prefixes on them (hashring.ReplicaRing), and
the router placing real requests on two fake-engine replicas by prefix or in turn. Whether placement
by prefix buys prompt-cache hits is measured on real llama-server replicas in
tests/evaluate/perf/test_prefix_cache.py."""

from __future__ import annotations

import json
import urllib.request
from collections import Counter

import pytest

from kiln.deploy.config import RouterConfig
from kiln.deploy.hashring import ReplicaRing
from kiln.deploy.router_process import RouterProcess
from kiln.engine.serve.fake import FakeServer
from tests.deploy.fakes import fake

URLS = [f"http://127.0.0.1:{8000 + k}" for k in range(3)]
SYSTEM = "You are a careful assistant. " * 12  # longer than the router's 256 prefix characters


def test_a_key_keeps_its_replica_and_keys_spread_over_all():
    ring = ReplicaRing(URLS)
    keys = [f"prefix {i}" for i in range(3000)]
    owners = [ring.order(k)[0] for k in keys]
    assert owners == [ReplicaRing(URLS).order(k)[0] for k in keys]  # a pure function of the key and the URLs
    share = Counter(owners)
    assert set(share) == {0, 1, 2} and all(800 < n < 1200 for n in share.values()), share
    assert all(sorted(ring.order(k)) == [0, 1, 2] for k in keys[:50])  # every replica offered, each once


def test_removing_a_replica_moves_only_its_own_keys():
    before, after = ReplicaRing(URLS), ReplicaRing(URLS[:2])
    for k in (f"prefix {i}" for i in range(2000)):
        owner = before.order(k)[0]
        if owner != 2:
            assert after.order(k)[0] == owner, k


def test_a_hot_prefix_spills_past_the_load_bound():
    ring = ReplicaRing(URLS[:2])
    own, other = ring.order("hot")
    assert ring.pick("hot", [0, 0], 1.25) == own
    loads = [0, 0]
    loads[own] = 1
    assert ring.pick("hot", loads, 1.25) == own  # 2 in flight against a bound of ceil(1.25 * 2 / 2) = 2
    loads[own] = 2
    assert ring.pick("hot", loads, 1.25) == other  # a third would be past ceil(1.25 * 3 / 2) = 2


def _send(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def replicas():
    with FakeServer(fake(ttft_ms=2, tpot_ms=1)) as a, FakeServer(fake(ttft_ms=2, tpot_ms=1)) as b:
        yield a, b


@pytest.mark.parametrize("balance", ["prefix", "round-robin"])
def test_the_router_places_requests_on_replicas_by_prefix_or_in_turn(replicas, balance):
    a, b = replicas
    for server in replicas:
        server.arrivals(reset=True)
    cfg = RouterConfig(port=0, stable_url=f"{a.url}, {b.url}/", balance=balance)
    with RouterProcess(cfg) as r:
        for i in range(12):  # one at a time: the load bound never moves a request
            _send(r.url, f"{SYSTEM}user turn {i}")
        counts = sorted(len(server.arrivals()) for server in replicas)
        sent = r.state()["replicas"]["stable"]
    # By prefix, one shared system prompt is one key: every request reaches the replica that holds it.
    assert counts == ([0, 12] if balance == "prefix" else [6, 6])
    assert sorted(s["sent"] for s in sent.values()) == counts and set(sent) == {a.url, b.url}


def test_replica_urls_are_checked():
    with pytest.raises(ValueError, match="stable_url: give http"):
        RouterConfig(stable_url="http://127.0.0.1:1,127.0.0.1:2")


def test_kiln_route_refuses_a_bad_balance_or_replica_url_naming_the_flag(tmp_path):
    from tests.pipeline.conftest import kiln

    bad_url = kiln("route", "--stable", "http://127.0.0.1:1,localhost:2", "--port", "0", "--insecure-no-api-key",
                   cwd=tmp_path)
    bad_balance = kiln("route", "--stable", "http://127.0.0.1:1", "--balance", "least-busy", "--port", "0",
                       "--insecure-no-api-key", cwd=tmp_path)
    assert bad_url.returncode == 2 and "stable_url: give http(s) URLs" in bad_url.stderr, bad_url.stderr[-500:]
    assert bad_balance.returncode == 2 and "--balance prefix|round-robin" in bad_balance.stderr, bad_balance.stderr[-500:]
