"""Exactness of a lossless lever: the candidate's greedy answers against its plain twin's.

Speculative decoding claims the text of the engine without it. The candidate answers the decode
benchmark's prompts (one at a time, as the benchmark asks: EOS ignored, no prompt cache) and the
served-text prompts (through its own `kiln serve`, `concurrency` in flight, as the served check asks),
then its engine is gone before the twin loads (one model in memory at a time). The twin is the same
engine folder loaded with `EngineConfig.plain_twin()`'s config, answering every prompt one at a time.

Where an answer splits from the twin's, the twin's log-prob gap between its own token and the
candidate's decides, by the rule every engine's parity check shares (kiln.evaluate.parity): within
TIE_TOLERANCE it is a near-tie that summation order may flip, beyond it the text changed. A twin that
cannot score (no log-probs to read) gives no gap: every split is then a change. Each record names the
prompt (set, index, excerpt), the position and the two tokens; the `lossless` gate check
(kiln.core.gate.lossless) fails on any change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError
from kiln.core.gate.lossless import APPLIES, DIVERGENCE, MATCH, NEAR_TIES
from kiln.engine.base import Engine
from kiln.evaluate.parity import TIE_TOLERANCE, divergence
from kiln.evaluate.quality.base import QualityResult
from kiln.evaluate.quality.served import one_at_a_time

EXCERPT = 40  # characters of a prompt a divergence quotes


@dataclass(frozen=True)
class PromptSet:
    """Prompts the candidate answered somewhere: `name` (benchmark, served), `new_tokens` each, and
    `concurrency` requests in flight at its server (None: one at a time on the engine itself)."""

    name: str
    prompts: list[list[int]]
    new_tokens: int
    concurrency: int | None = None


def alone(engine: Engine, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """Greedy answers, one request at a time, as the decode benchmark asks them (EOS ignored, prefill
    uncached)."""
    return one_at_a_time(engine, prompts, n, cache_prompt=False)


def candidate_answers(engine: Engine, load: Callable[[], Engine], tokenizer: Any, sets: Sequence[PromptSet],
                      close: Callable[[], None]) -> list[list[list[int]]]:
    """The candidate's answers per set: those asked one at a time from `engine`, then `close()` (it
    hands the engine back), then those served under load by a `kiln serve` of `load()`."""
    from kiln.evaluate.quality.served import mixed_order, under_load

    out: list[list[list[int]]] = [alone(engine, s.prompts, s.new_tokens) if s.concurrency is None else []
                                  for s in sets]
    close()
    for k, s in enumerate(sets):
        if s.concurrency is not None:
            order = mixed_order(s.prompts)
            served = under_load(load, tokenizer, [s.prompts[i] for i in order], s.new_tokens, s.concurrency)
            out[k] = [served[order.index(i)] for i in range(len(s.prompts))]
    return out


def exactness(twin: Engine, sets: Sequence[PromptSet], got: Sequence[Sequence[list[int]]]) -> QualityResult:
    """The twin's answers to every set, one at a time, and each of the candidate's `got` judged
    against them (`record`)."""
    decode = getattr(twin.tokenizer, "decode", None)
    records = []
    for s, answers in zip(sets, got, strict=True):
        want = alone(twin, s.prompts, s.new_tokens)
        records += [record(twin, s.name, i, p, w, g, decode)
                    for i, (p, w, g) in enumerate(zip(s.prompts, want, answers, strict=True))]
    changed = sum(not r[MATCH] for r in records)
    ties = sum(r[MATCH] and r["candidate"] != r["twin"] for r in records)
    return QualityResult("lossless", records, {APPLIES: 1.0, MATCH: 1 - changed / len(records),
                                               NEAR_TIES: float(ties), "lossless_answers": float(len(records))})


def record(twin: Engine, name: str, index: int, prompt: list[int], want: list[int], got: list[int],
           decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """One answer against the twin's: where it split, the twin's log-prob gap there, and, for a real
    change, a line naming the prompt, the position and the two tokens."""
    matched, gap = (len(want), None) if got == want else _split(twin, prompt, want, got)
    same = got == want or (gap is not None and gap <= TIE_TOLERANCE)
    where = ""
    if not same:
        excerpt = _excerpt(decode, prompt)
        why = (f"the twin's log-prob gap {gap:.3g} > tolerance {TIE_TOLERANCE:g}" if gap is not None
               else "the twin cannot score, so no near-tie can be told" if matched < min(len(want), len(got))
               else f"{len(got)} tokens where the twin wrote {len(want)}")
        where = (f"{name} prompt {index} ({excerpt}) at generated token {matched}: twin "
                 f"{_token(decode, want, matched)}, candidate {_token(decode, got, matched)}; {why}")
    return {"doc_id": f"{name} {index}", "prompt_tokens": len(prompt), "matched_tokens": matched, "tie_gap": gap,
            MATCH: float(same), DIVERGENCE: where, "twin": want, "candidate": got}


def _split(twin: Engine, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float | None]:
    try:
        return divergence(twin, prompt, want, got)
    except (NotImplementedError, KilnError):  # a twin that only generates: no gap to read
        return next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got))), None


def _excerpt(decode: Callable[[list[int]], str] | None, prompt: list[int]) -> str:
    text = decode(prompt) if decode else " ".join(map(str, prompt))
    text = " ".join(text.split())
    return repr(text if len(text) <= EXCERPT else text[:EXCERPT] + "…")


def _token(decode: Callable[[list[int]], str] | None, tokens: list[int], at: int) -> str:
    if at >= len(tokens):
        return "(ended)"
    return f"{decode([tokens[at]])!r} (id {tokens[at]})" if decode else f"id {tokens[at]}"
