"""In-process decode benchmark: TTFT and decode speed of baseline and candidate, interleaved.

The quick performance signal of `kiln run` (the served, open-loop load test is `evaluate/perf`).
Both engines run the same prompts with a fixed output length (EOS ignored, so a model that stops
early cannot look faster), in repeats that alternate which arm goes first (A B, B A, …) so machine
drift lands on both arms alike. Each repeat yields one value per metric per arm; the gate compares
their ratios with an interval across repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from kiln.engine.base import Engine, GenerationRequest


def _one_request(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    """(TTFT seconds, decode seconds after the first token, decode tokens)."""
    start = time.perf_counter()
    engine.add(GenerationRequest(prompt, new_tokens, ignore_eos=True))
    times = []
    while engine.has_work():
        times.extend(ev.time for ev in engine.step())
    return times[0] - start, times[-1] - times[0], len(times) - 1


def _batch(engine: Engine, prompts: Sequence[list[int]], new_tokens: int) -> float:
    """Aggregate output tokens per second with all prompts decoding together."""
    start = time.perf_counter()
    n = sum(1 for _ in engine.generate([GenerationRequest(p, new_tokens, ignore_eos=True) for p in prompts]))
    return n / (time.perf_counter() - start)


def measure(engine: Engine, prompts: Sequence[list[int]], new_tokens: int, batch_sizes: Sequence[int]) -> dict[str, float]:
    ttfts, decode_s, decode_tokens = [], 0.0, 0
    for p in prompts:
        ttft, dt, n = _one_request(engine, p, new_tokens)
        ttfts.append(ttft)
        decode_s += dt
        decode_tokens += n
    out = {"ttft_ms": 1000 * statistics.median(ttfts), "decode_tok_s": decode_tokens / decode_s,
           "tpot_ms": 1000 * decode_s / decode_tokens}
    for b in batch_sizes:
        if b > 1:
            out[f"batch{b}_tok_s"] = _batch(engine, (list(prompts) * b)[:b], new_tokens)
    return out


def interleaved(engines: dict[str, Engine], prompts: Sequence[list[int]], new_tokens: int,
                batch_sizes: Sequence[int], repeats: int) -> dict[str, list[dict[str, float]]]:
    """Per arm, one measurement dict per repeat; arm order alternates every repeat."""
    names = list(engines)
    for name in names:  # warm-up: first-call allocations and lazy init must not count
        measure(engines[name], prompts[:1], 4, [])
    out: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(measure(engines[name], prompts, new_tokens, batch_sizes))
    return out
