"""In-process decode benchmark: TTFT and decode speed of baseline and candidate, interleaved.

The quick performance signal of `kiln run` (the served, open-loop load test is `evaluate/perf`).
Both engines run the same prompts with a fixed output length (EOS ignored, so a model that stops
early cannot look faster), each prefilled in full (`cache_prompt=False`: every round repeats the
prompts, and with llama-server's prompt cache the demo's q4_1 candidate, which prefills ~180 tok/s
here, reported a 22 ms TTFT on 26-110-token prompts against torch's uncached 149 ms).

The unit of comparison is one prompt run on both arms back to back, in an order that alternates
pair by pair (A B, B A, …): on a 2-core CPU the speed of one request varies by ±15-25% from the
next, and that noise is per request, not slow drift, so many short adjacent pairs give a far tighter
ratio interval than a few long repeats of the same total duration (measured: per-pair log-ratio sd
0.17 on 16-token, 0.25 on 32-token requests). Each round runs every prompt once; each pair is one
paired sample per metric, and the gate takes its interval across all of them.

Given a contention `Watch`, each arm's half of a pair is also watched: its CPU pressure and steal
are recorded as paired samples beside its speed (kiln.evaluate.contention.as_metrics names them),
so the gate can tell steady load, which both halves share and pairing cancels, from load that
changed between them, which it cannot.

An engine that speculates (llama.cpp's server runtime with `engine.speculative`) reports per request the
tokens it drafted and those the model accepted (TokenEvent.stats): recorded beside the speeds, so the
benchmark's prompts, whose repetition decides what a draft is worth, show the acceptance rate behind
a speed-up or a slow-down (`speculation`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from kiln.core import progress
from kiln.core.metrics import SPEC_PAYS_UP_TO as PAYS_UP_TO, SPEC_STOPS_PAYING as STOPS_PAYING, sweep_ratio
from kiln.engine.base import Engine, GenerationRequest
from kiln.evaluate.contention import Watch, as_metrics

# TokenEvent.stats' drafting figures, recorded per request as the speeds are (core/metrics.py declares them).
DRAFT_TOKENS, DRAFT_ACCEPTED, ACCEPTANCE_RATE = "draft_tokens", "draft_accepted", "acceptance_rate"
SPECULATION = (DRAFT_TOKENS, DRAFT_ACCEPTED)


def _one_request(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[float, float, int, dict | None]:
    """(TTFT seconds, decode seconds after the first token, decode tokens, the engine's figures of
    the request: TokenEvent.stats of its last event)."""
    start = time.perf_counter()
    engine.add(GenerationRequest(prompt, new_tokens, ignore_eos=True, cache_prompt=False))
    events = []
    while engine.has_work():
        events.extend(engine.step())
    return events[0].time - start, events[-1].time - events[0].time, len(events) - 1, events[-1].stats


def _batch(engine: Engine, prompts: Sequence[list[int]], new_tokens: int) -> float:
    """Aggregate output tokens per second with all prompts decoding together."""
    start = time.perf_counter()
    n = sum(1 for _ in engine.generate([GenerationRequest(p, new_tokens, ignore_eos=True, cache_prompt=False)
                                        for p in prompts]))
    return n / (time.perf_counter() - start)


def _single(engine: Engine, prompt: list[int], new_tokens: int) -> dict[str, float]:
    ttft, dt, n, stats = _one_request(engine, prompt, new_tokens)
    drafts = {k: stats[k] for k in SPECULATION if k in stats} if stats else {}  # an engine that speculates
    return {"ttft_ms": 1000 * ttft, "decode_tok_s": n / dt, "tpot_ms": 1000 * dt / n, **drafts}


def speculation(samples: dict[str, list[float]]) -> dict[str, float]:
    """An arm's speculative decoding over the benchmark, where its engine reported drafts: tokens drafted
    and accepted per request (means) and the acceptance rate, accepted / drafted over all requests
    (absent when nothing was drafted). Empty for an engine that does not speculate."""
    if DRAFT_TOKENS not in samples:
        return {}
    drafted, accepted = sum(samples[DRAFT_TOKENS]), sum(samples[DRAFT_ACCEPTED])
    n = len(samples[DRAFT_TOKENS])
    return {DRAFT_TOKENS: drafted / n, DRAFT_ACCEPTED: accepted / n,
            **({ACCEPTANCE_RATE: accepted / drafted} if drafted else {})}


def _watched(engine: Engine, prompt: list[int], new_tokens: int, watch: Watch | None) -> dict[str, float]:
    """One request's figures and, given `watch`, the machine's over it (read outside the timed part)."""
    if watch is None:
        return _single(engine, prompt, new_tokens)
    start = watch.read()
    figures = _single(engine, prompt, new_tokens)
    return {**figures, **as_metrics(watch.over(start, watch.read()))}


def interleaved(engines: dict[str, Engine], prompts: Sequence[list[int]], new_tokens: int,
                batch_sizes: Sequence[int], rounds: int,
                stop: Callable[[dict[str, dict[str, list[float]]]], bool] | None = None,
                watch: Watch | None = None) -> dict[str, dict[str, list[float]]]:
    """Per arm, metric -> paired samples (sample i of every arm saw the same moment of the machine).

    Single-request metrics give one sample per (round, prompt); batch throughput, one per round.
    `stop`, asked after every round but the last with the samples so far: True ends the
    measurement there (the caller's rule, e.g. a check already decided). `watch`: the machine's
    contention over each single request is recorded too, paired as the speeds are.
    """
    names = list(engines)
    for name in names:  # warm-up: first-call allocations and lazy init must not count
        engines[name].release_scoring()  # it only generates: a scorer an earlier stage made (OpenVINO's) goes first
        _one_request(engines[name], prompts[0], 4)
    out: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    pair = 0
    progress.total(rounds * (len(prompts) + sum(b > 1 for b in batch_sizes)), "pairs")
    for done in range(rounds):
        for prompt in prompts:
            for name in names if pair % 2 == 0 else reversed(names):
                for k, v in _watched(engines[name], prompt, new_tokens, watch).items():
                    out[name].setdefault(k, []).append(v)
            pair += 1
            progress.advance()
        for b in (b for b in batch_sizes if b > 1):
            for name in names if pair % 2 == 0 else reversed(names):
                out[name].setdefault(f"batch{b}_tok_s", []).append(
                    _batch(engines[name], (list(prompts) * b)[:b], new_tokens))
            pair += 1
            progress.advance()
        if stop is not None and done + 1 < rounds and stop(out):
            break
    return out


# Where speculation stops paying (issue 53: "find the batch size where it stops helping"): the concurrency
# levels a speculating candidate and its plain twin are compared at.
SWEEP_CONCURRENCY = (1, 2, 4, 8)


def concurrency_sweep(engines: dict[str, Engine], prompts: Sequence[list[int]], new_tokens: int, rounds: int,
                      levels: Sequence[int] = SWEEP_CONCURRENCY) -> dict[str, dict[str, list[float]]]:
    """Per arm, `c<level>_tok_s` -> aggregate output tok/s with `level` requests decoding together, paired:
    at each level the prompts are cut into groups of `level` (the set repeated where it is shorter), each
    group one pair, run on both arms back to back in an order that alternates pair by pair."""
    names = list(engines)
    for name in names:  # warm-up, as `interleaved`'s
        _one_request(engines[name], prompts[0], 4)
    out: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    pair = 0
    progress.total(rounds * sum(max(1, len(prompts) // c) for c in levels), "pairs")
    for _ in range(rounds):
        for c in levels:
            cycled = list(prompts) * -(-c // len(prompts))
            for i in range(max(1, len(prompts) // c)):
                group = cycled[i * c:(i + 1) * c]
                for name in names if pair % 2 == 0 else reversed(names):
                    out[name].setdefault(f"c{c}_tok_s", []).append(_batch(engines[name], group, new_tokens))
                pair += 1
                progress.advance()
    return out


def stops_paying(fast: dict[str, list[float]], plain: dict[str, list[float]], confidence: float,
                 levels: Sequence[int] = SWEEP_CONCURRENCY) -> dict[str, float]:
    """Per level, the speculating arm's aggregate tok/s over its plain twin's (geometric mean of the paired
    ratios, Student-t interval on their logs); `speculation_stops_paying_at`: the first level whose interval
    no longer sits wholly above 1 (absent when every level's does), `speculation_pays_up_to`: the last
    level before it (0: not even at the first)."""
    from kiln.core.gate.performance import t_interval

    figures: dict[str, float] = {}
    pays_up_to = 0
    for c in levels:
        logs = np.log(np.asarray(fast[f"c{c}_tok_s"]) / np.asarray(plain[f"c{c}_tok_s"]))
        mean, lo, hi = t_interval(logs, confidence) if len(logs) > 1 else (float(logs.mean()), -np.inf, np.inf)
        figures.update({sweep_ratio(c): math.exp(mean), f"{sweep_ratio(c)}_lo": math.exp(lo),
                        f"{sweep_ratio(c)}_hi": math.exp(hi)})
        if STOPS_PAYING not in figures:
            if lo > 0:
                pays_up_to = c
            else:
                figures[STOPS_PAYING] = c
    return {**figures, PAYS_UP_TO: pays_up_to}

