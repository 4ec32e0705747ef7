"""The prompt cache measured where it acts, on the real counterparts: kiln serve over llama-server (the
tiny Llama's GGUF) reports the prompt tokens its engine served from the cache, the load client reads
them, the prefix-sharing workload reports its hit rate with the cache and without, and `kiln route`
in front of two such replicas keeps a prompt prefix on the replica that holds it (the load stage's
`prefix.router`), against round-robin."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from kiln.engine.llama_cpp.config import LlamaCppConfig
from kiln.engine.serve.server_thread import ServerThread
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.perf.prefix import HIT_RATE, ROUND_ROBIN_HIT_RATE, ROUTED_HIT_RATE
from kiln.evaluate.perf.prefix_run import run_prefix
from kiln.pipeline.report.report import _prefix_table
from tests.llama_cpp_build import require_llama_cpp


@pytest.fixture(scope="module")
def engine_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """One slot per server: its KV holds the last prompt, so a prefix is warm where it was last served."""
    from kiln.engine.cache import write_engine

    require_llama_cpp()
    out = tmp_path_factory.mktemp("llama-prefix")
    write_engine(LlamaCppConfig(threads=1, parallel=1, ctx_per_slot=512), tiny_model_dir, "test-checkpoint", out)
    return out


@pytest.fixture(scope="module")
def server(engine_dir):
    with ServerThread(engine_dir, model_name="tiny") as s:
        yield s


def _complete(url: str, prompt: list[int], **extra) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        line = next(ln for ln in r.read().decode().splitlines() if ln.startswith(f"{name}_total "))
    return float(line.split()[1])


def test_kiln_serve_reports_the_prompt_tokens_its_engine_served_from_cache(server):
    system = list(range(2000, 2100))
    before = _counter(server.url, "kiln:prefix_cache_hits"), _counter(server.url, "kiln:prefix_cache_queries")
    _complete(server.url, system + [3000, 3001])  # fills the slot
    warm = _complete(server.url, system + [3002, 3003, 3004])["usage"]
    cold = _complete(server.url, system + [3005], cache_prompt=False)["usage"]
    assert warm["prompt_tokens"] == 103 and 100 <= warm["prompt_tokens_details"]["cached_tokens"] < 103, warm
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0, cold  # asked not to use the cache
    hits = _counter(server.url, "kiln:prefix_cache_hits") - before[0]
    queries = _counter(server.url, "kiln:prefix_cache_queries") - before[1]
    assert queries == 102 + 103 + 101 and hits >= warm["prompt_tokens_details"]["cached_tokens"]


def test_the_prefix_workload_reports_its_hit_rate_with_and_without_the_cache(server):
    cfg = PerformanceConfig.model_validate({"repeats": 1, "workload": {"input_tokens": {"mean": 96}},
                                            "prefix": {"requests": 6, "user_tokens": 8, "output_tokens": 2}})
    part = run_prefix({"tiny": server.url}, cfg)["tiny"]
    on, off = part["cached"]["cache_hit_rate"][0], part["uncached"]["cache_hit_rate"][0]
    # The window ends where the last request was sent, so 5 of the 6 count; each after the first (a new
    # system prompt: the cached run went first) reuses at least the 96-token system prompt of its 104.
    assert 4 / 5 * 96 / 104 <= on < 1 and off == 0, part
    assert part["metrics"][HIT_RATE] == on and part["system_tokens"] == 96 and part["cached"]["errors"] == [0]
    (title, header, rows), = _prefix_table({"tiny": {"prefix": part}})  # the report's table
    assert rows[0][0] == "tiny" and rows[0][1] == "96 + 8" and rows[0][-1] == f"{on:.0%}"


def test_the_router_keeps_prompt_caches_warm_by_prefix(engine_dir):
    """The load stage's `prefix.router`: two kiln serve replicas (one slot each) of the engine behind a
    real `kiln route`; 4 system prompts, each request drawing one, one request at a time. By prefix a
    system prompt has one replica, so it is warm there more often than when both replicas take every
    system prompt in turn. Each run's system prompts are new to both replicas (its own seed)."""
    from kiln.pipeline.stages.load import replicas_hit_rates

    cfg = PerformanceConfig.model_validate({"repeats": 1, "workload": {"input_tokens": {"mean": 96}}, "prefix": {
        "requests": 24, "prefixes": 4, "output_tokens": 1, "router": True}})
    routed = replicas_hit_rates(engine_dir, cfg)
    rates, sent = {k: v[0] for k, v in routed["cache_hit_rate"].items()}, {k: v[0] for k, v in routed["sent"].items()}
    assert sum(sent["prefix"]) == sum(sent["round-robin"]) == 24 and sent["round-robin"] == [12, 12], sent
    assert rates["prefix"] > rates["round-robin"] + 0.1, (rates, sent)
    assert routed["metrics"] == {ROUTED_HIT_RATE: rates["prefix"], ROUND_ROBIN_HIT_RATE: rates["round-robin"]}
    tables = _prefix_table({"tiny": {"prefix": {"system_tokens": 96, "user_tokens": 16, "prefixes": 4,
                                                "concurrency": 1, "metrics": {}, "router": routed}}})
    assert tables[1][2] == [["tiny", f"{rates['prefix']:.0%}", f"{rates['round-robin']:.0%}"]]
