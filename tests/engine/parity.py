"""Parity checks shared by the native-engine backend tests: each backend against the torch one.

Tolerances (stated once, used by every backend test):
- full precision: >= 90% of greedy 16-token continuations identical; per-token log-likelihoods
  and next-token log-probabilities within 1e-3 (kernel summation order differs, so not 0);
- 8-bit weights: >= 60% identical continuations, mean |delta log-prob| per token < 0.1 and
  the same greedy first token on >= 90% of prompts (a random tiny model has flat logits, so
  8-bit rounding flips near-ties; measured values are in docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kiln.engine.base import Engine, GenerationRequest

FULL = {"identical": 0.9, "logprob_atol": 1e-3}
INT8 = {"identical": 0.6, "mean_abs_logprob": 0.1, "first_token": 0.9}


def build(config, checkpoint: Path, out: Path) -> Engine:
    """Build `config` from `checkpoint` into `out` the way kiln does, then load it by manifest."""
    from kiln.engine.cache import write_engine
    from kiln.engine.loader import load_engine

    out.mkdir(parents=True, exist_ok=True)
    write_engine(config, checkpoint, "test-checkpoint", out)
    return load_engine(out)


def prompts(tokenizer, n: int = 10) -> list[list[int]]:
    words = ("the quick brown fox", "kiln models serve tokens", "seven bright stars shine above",
             "rivers run to the sea and", "every engine must score", "users measure latency",
             "a lazy dog while quiet hills", "fast under load every", "with care because", "text and quality")
    return [tokenizer(words[i % len(words)] + " " * (i // len(words)))["input_ids"] for i in range(n)]


def greedy(engine: Engine, prompt_ids: list[list[int]], n: int = 16) -> list[list[int]]:
    """All prompts submitted at once (exercises the backend's batching), ignore_eos, n tokens."""
    ids = [engine.add(GenerationRequest(p, n, ignore_eos=True)) for p in prompt_ids]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for e in engine.step():
            out[e.seq_id].append(e.token_id)
    return [out[i] for i in ids]


def run(engine: Engine, requests: Sequence[GenerationRequest], joins: Sequence[int]) -> list[list[int]]:
    """Each request's tokens, request i added after `joins[i]` steps (0: before the first), so later
    ones join the sequences already decoding; an idle engine takes the next waiting request at once."""
    waiting = sorted(range(len(requests)), key=lambda i: joins[i])
    owner: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    steps = 0
    while waiting or engine.has_work():
        while waiting and (joins[waiting[0]] <= steps or not engine.has_work()):
            i = waiting.pop(0)
            owner[engine.add(requests[i])] = i
        for e in engine.step():
            out[owner[e.seq_id]].append(e.token_id)
        steps += 1
    return out


def identical_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def score_pairs(prompt_ids: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    return [(p[:3], p[3:] + p[:2]) for p in prompt_ids]


def logprob_deltas(engine: Engine, reference: Engine, pairs) -> np.ndarray:
    got, want = engine.score(pairs), reference.score(pairs)
    return np.concatenate([np.abs(np.subtract(g.token_logprobs, w.token_logprobs))
                           for g, w in zip(got, want, strict=True)])
