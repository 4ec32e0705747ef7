"""Running the prefix-sharing workload (its config and metrics: prefix.py): each arm with its prompt
cache and without, interleaved over repeats, and the figures the load stage reports."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from kiln.evaluate.perf.concurrent import ConcurrentConfig
from kiln.evaluate.perf.config import LengthDistribution, PerformanceConfig, Trim
from kiln.evaluate.perf.prefix import CACHED_TTFT, HIT_RATE, TTFT_DROP, UNCACHED_TTFT
from kiln.evaluate.perf.runner import LoadResult, run_load


def prefix_load(cfg: PerformanceConfig, cache: bool) -> PerformanceConfig:
    """The load config of one run of the recipe's prefix workload, with the prompt cache or without."""
    p = cfg.prefix
    assert p is not None
    system = p.system_tokens or cfg.workload.input_tokens.mean
    total = system + p.user_tokens
    workload = cfg.workload.model_copy(update={
        "dataset": None, "input_tokens": LengthDistribution(mean=total), "shared_prefix_fraction": system / total,
        "prefixes": p.prefixes, "unique": True, "cache_prompt": cache})
    return cfg.model_copy(update={
        "shape": ConcurrentConfig(concurrency=p.concurrency), "workload": workload, "output_tokens": p.output_tokens,
        "max_requests": p.requests, "duration_s": p.timeout_s, "warmup": Trim(), "cooldown": Trim(), "prefix": None})


def run_prefix(urls: Mapping[str, str], cfg: PerformanceConfig, api_key: str | None = None) -> dict[str, dict]:
    """Every arm (role -> its server's URL, served under the role's name) with and without the cache,
    `cfg.repeats` times, interleaved; returns each arm's `prefix_result`."""
    runs: dict[str, dict[bool, list[LoadResult]]] = {role: {True: [], False: []} for role in urls}
    for k in range(cfg.repeats):
        for role, url in urls.items():
            for cache in (True, False) if k % 2 == 0 else (False, True):
                salt = f"p{k}{'c' if cache else 'n'}"  # new user turns each run: only the system prompt is shared
                runs[role][cache].append(run_load(url, prefix_load(cfg, cache), api_key, role, salt))
    return {role: prefix_result(cfg, r[True], r[False]) for role, r in runs.items()}


def _figures(runs: list[LoadResult]) -> dict[str, list[Any]]:
    return {"ttft_p50_ms": [r.summary.ttft_ms["p50"] for r in runs],
            "ttft_p95_ms": [r.summary.ttft_ms["p95"] for r in runs],
            "cache_hit_rate": [r.summary.cache_hit_rate for r in runs],
            "errors": [r.summary.errors for r in runs]}


def _median(values: list[Any]) -> float | None:
    return statistics.median(values) if values and None not in values else None


def prefix_result(cfg: PerformanceConfig, cached: list[LoadResult], uncached: list[LoadResult]) -> dict[str, Any]:
    """One arm: the workload's shape, per-repeat figures with and without the cache, and the medians
    as the load stage's metrics (the hit rate only where the server reported one)."""
    p = cfg.prefix
    assert p is not None
    on, off = _figures(cached), _figures(uncached)
    repeats = {CACHED_TTFT: on["ttft_p50_ms"], UNCACHED_TTFT: off["ttft_p50_ms"], HIT_RATE: on["cache_hit_rate"],
               TTFT_DROP: [1 - x / y for x, y in zip(on["ttft_p50_ms"], off["ttft_p50_ms"], strict=True)]}
    repeats = {k: v for k, v in repeats.items() if None not in v and all(map(math.isfinite, v))}
    a, b = _median(on["ttft_p50_ms"]), _median(off["ttft_p50_ms"])
    metrics = {CACHED_TTFT: a, UNCACHED_TTFT: b, HIT_RATE: _median(on["cache_hit_rate"]),
               TTFT_DROP: 1 - a / b if a is not None and b else None}
    return {"system_tokens": p.system_tokens or cfg.workload.input_tokens.mean, "user_tokens": p.user_tokens,
            "prefixes": p.prefixes, "concurrency": p.concurrency, "requests": p.requests,
            "cached": on, "uncached": off, "repeats": repeats,
            "metrics": {k: v for k, v in metrics.items() if k in repeats}}
