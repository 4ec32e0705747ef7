"""Every Prometheus name kiln exports or queries, in one place (vLLM keeps its serving metrics in
one module the same way). `kiln serve` (engine/serve/scheduler.py, engine/serve/server.py), the fake engine,
`kiln route` and the rendered AnalysisTemplates / KEDA trigger all import these; none spells a
name itself, so what the renderer queries is what the server exports.

Names follow vLLM's (`vllm:` becomes `kiln:`) so dashboards carry over; counters are exported with
`_total` (prometheus_client appends it), histograms with `_sum`/`_count`/`_bucket`, and an outcome
is a label, not a metric of its own.
"""

from __future__ import annotations

# Per-request latency histograms (seconds).
TTFT = "kiln:time_to_first_token_seconds"
TPOT = "kiln:time_per_output_token_seconds"  # mean time between output tokens, after the first
E2E = "kiln:e2e_request_latency_seconds"
# Gauges.
RUNNING = "kiln:num_requests_running"  # submitted, not finished
WAITING = "kiln:num_requests_waiting"  # waiting for a slot / their first token: the autoscaling signal
COLD_START = "kiln:cold_start_seconds"  # label phase: boot, load, warmup, total
# Counters (exported as <name>_total).
PROMPT_TOKENS = "kiln:prompt_tokens"
GENERATION_TOKENS = "kiln:generation_tokens"
REQUESTS = "kiln:requests"  # label OUTCOME, one of OUTCOMES
# The engine's prompt (prefix) cache, in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: the
# prompt tokens of requests whose engine reported a cache figure, and those of them served from the cache.
# Only engines that report one count (llama.cpp's server runtime: llama-server's `cache_n`).
PREFIX_CACHE_QUERIES = "kiln:prefix_cache_queries"
PREFIX_CACHE_HITS = "kiln:prefix_cache_hits"
ADMISSION = "kiln:admission"  # prefix of the admission controller's own series

OUTCOME = "outcome"
SUCCESS, CLIENT_ERROR, SERVER_ERROR, REJECTED = "success", "client_error", "server_error", "rejected"
CANCELLED = "cancelled"  # the client left before the answer was complete (logged as status 499)
OUTCOMES = (SUCCESS, CLIENT_ERROR, SERVER_ERROR, REJECTED, CANCELLED)


def total(counter: str) -> str:
    """The exported name of a counter."""
    return counter + "_total"


def outcome(status: int, failed_mid_stream: bool = False) -> str:
    """A finished request's outcome from its HTTP status: 429 and 503 are capacity refusals (a
    full queue, a draining or loading server), 499 a client that left, other 4xx (401 included)
    the client's mistake, 5xx or a stream that ended in an error event the server's."""
    if status == 499:
        return CANCELLED
    if failed_mid_stream or (status >= 500 and status != 503):
        return SERVER_ERROR
    if status in (429, 503):
        return REJECTED
    return CLIENT_ERROR if status >= 400 else SUCCESS

# `kiln route`: per-arm series (label ARM: stable | canary).
ARM = "arm"
ROUTER_REQUESTS = "kiln:router_requests"  # labels ARM, OUTCOME (success, client_error, server_error)
ROUTER_RETRIES = "kiln:router_retries"
ROUTER_TTFT = "kiln:router_time_to_first_token_seconds"
ROUTER_TPOT = "kiln:router_time_per_output_token_seconds"
ROUTER_E2E = "kiln:router_e2e_request_latency_seconds"
ROUTER_IN_FLIGHT = "kiln:router_num_requests_running"
ROUTER_WAITING = "kiln:router_num_requests_waiting"
ROUTER_WEIGHT = "kiln:router_canary_weight_percent"
# Mirrored greedy prompts scored as the offline served-text check scores a pair (histograms of
# per-prompt scores in [0, 1]; label PAIR: MIRROR_CANARY = canary vs stable, MIRROR_FLOOR = stable
# vs stable, the noise floor). The rendered AnalysisTemplates judge their means.
ROUTER_MIRROR_PREFIX = "kiln:router_mirror_served_prefix"
ROUTER_MIRROR_MATCH = "kiln:router_mirror_served_match"
PAIR = "pair"
MIRROR_CANARY, MIRROR_FLOOR = "canary", "floor"
ROUTER_MIRROR_DROPPED = "kiln:router_mirror_dropped"  # label REASON: MIRROR_LOAD (shed for clients) | MIRROR_FAILED
REASON = "reason"
MIRROR_LOAD, MIRROR_FAILED = "load", "failed"
