"""The prefix-sharing workload: a shared system prompt, then distinct user turns, measured with the
server's prompt cache and without it, so the report shows what the cache buys (TTFT) beside how
much of each prompt it served (the hit rate).

Each run is closed loop: `concurrency` users, `requests` requests, synthetic prompts of exact
lengths (token ids on the completions endpoint, words on chat): a system prompt of `system_tokens`
(default: the recipe's prompt length, `workload.input_tokens.mean`), then a marker unique to the
request and the user's own tokens. With `prefixes` > 1 each request draws one of that many system
prompts. The same workload goes out with `cache_prompt: true` and with `false` (llama.cpp's
request field; kiln serve hands it to its engine), which one first alternating repeat by repeat.
The two runs of a repeat differ in their user turns only, so only the system prompt can be reused.

With `router`, the load stage also sends the workload (cache on) through `kiln route` in front of two
replicas of the arm's engine, placed by prefix and round-robin (pipeline/stages/load.py: the router
is a layer above this one), and reports both hit rates.

The hit rate is the server's own figure, `usage.prompt_tokens_details.cached_tokens` over prompt
tokens (kiln serve fills it from llama-server's `cache_n`). An engine that reports none has no hit
rate, and its two TTFTs should not differ: nothing was cached.

This module holds the recipe's section and the metrics' names (config.py imports it); running the
workload is prefix_run.py's.
"""

from __future__ import annotations

from pydantic import Field

from kiln.core.metrics import LOAD_PREFIX, declare
from kiln.evaluate.perf.rules import Strict

# The load stage's per-arm figures of this workload (medians over repeats).
CACHED_TTFT, UNCACHED_TTFT = LOAD_PREFIX + "prefix_ttft_p50_ms", LOAD_PREFIX + "prefix_uncached_ttft_p50_ms"
HIT_RATE, TTFT_DROP = LOAD_PREFIX + "prefix_cache_hit_rate", LOAD_PREFIX + "prefix_ttft_drop"
_WHERE = "evaluate.load.prefix"
declare(CACHED_TTFT, False, "ms", "time to first token, median, of the prefix-sharing workload with the prompt "
        "cache on", "performance", _WHERE)
declare(UNCACHED_TTFT, False, "ms", "time to first token, median, of the prefix-sharing workload with the "
        "prompt cache off (cache_prompt: false)", "performance", _WHERE)
declare(HIT_RATE, True, "fraction", "prompt tokens the server served from its prompt cache / prompt tokens, "
        "prefix-sharing workload with the cache on", "performance", _WHERE)
declare(TTFT_DROP, True, "fraction", "1 - cached / uncached median TTFT of the prefix-sharing workload",
        "performance", _WHERE)
ROUTED_HIT_RATE = LOAD_PREFIX + "prefix_routed_hit_rate"
ROUND_ROBIN_HIT_RATE = LOAD_PREFIX + "prefix_round_robin_hit_rate"
declare(ROUTED_HIT_RATE, True, "fraction", "prompt-cache hit rate of the prefix-sharing workload through kiln route "
        "in front of two replicas, placed by a hash of the prompt prefix", "performance", _WHERE)
declare(ROUND_ROBIN_HIT_RATE, True, "fraction", "the same, the two replicas taken in turn (round-robin)",
        "performance", _WHERE)
declare(LOAD_PREFIX + "cache_hit_rate", True, "fraction", "prompt tokens the server served from its prompt "
        "cache / prompt tokens (served over HTTP under the load shape)", "performance", "evaluate.load")


class PrefixConfig(Strict):
    """The recipe's `evaluate.load.prefix`: the prefix-sharing workload the load stage adds per arm."""

    system_tokens: int | None = Field(
        None, ge=1, description="length of the shared system prompt; None: the recipe's prompt length "
        "(workload.input_tokens.mean)")
    user_tokens: int = Field(16, ge=4, description="the distinct user turn after it (its first 3 tokens mark it)")
    prefixes: int = Field(1, ge=1, description="distinct system prompts, each request drawing one")
    concurrency: int = Field(1, ge=1, description="closed-loop users")
    requests: int = Field(16, ge=3, description="requests per run (one run with the cache, one without, per repeat)")
    output_tokens: int = Field(8, ge=1, description="tokens generated per request (TTFT is the figure)")
    timeout_s: float = Field(120.0, gt=0, description="longest a run may send for")
    router: bool = Field(False, description="also through kiln route in front of two replicas of the arm's engine, "
                         "placed by prefix and round-robin (starts the engine twice more)")
