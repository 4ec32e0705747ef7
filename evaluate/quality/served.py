"""The served text, under load: what the candidate's `kiln serve` writes when requests overlap.

Log-likelihood checks (perplexity, agreement, lm-eval) never look at the tokens a server
generates under concurrent traffic, so an engine that decodes wrongly only when requests of
different lengths share a batch (issue #18: CTranslate2's cohorts) passes all of them. Here the
candidate's engine runs behind the real HTTP server on a loopback port, and prompts of mixed
lengths are streamed to it `concurrency` at a time (a finished request is replaced at once, so
newcomers join a running batch). The reference is the baseline engine, one request at a time:
nothing batched, so nothing a batching bug can touch. A one-token prompt and the shortest prompts
the tokenizer makes join the recipe's prompts (kiln.evaluate.parity.with_shortest): one user's
one-token prompt made CTranslate2 stream every other prompt of its batch as "generated" (issue 39).
With `shared_prefix`, the recipe's prompts all start with the same tokens (a system prompt), so the
candidate's server answers most of them from its prompt cache (llama-server's, and its
`engine.cache_reuse`): a cache that reuses wrongly writes different text than the reference, which
never caches (issue 53: prompt-cache reuse is judged here).

Per prompt: how many leading greedy tokens match the reference (`served_prefix`, as a fraction
of `max_new_tokens`) and whether all of them do (`served_match`). The gate bounds either with an
`agreement` check (a BCa bootstrap over prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.core import progress
from kiln.core.files import hash_of
from kiln.engine.base import Engine, GenerationRequest
from kiln.evaluate.parity import SHORTEST_TEXTS, with_shortest
from kiln.evaluate.quality.base import QUALITY_EVALS, EvalInputs, QualityEval, QualityResult
from kiln.core.metrics import declare

MODEL = "candidate"  # the name the test server serves under

declare("served_match", True, "fraction", "prompts whose greedy continuation from the candidate's server under "
        "concurrent load equals the baseline's, token for token", "quality", "evaluate.quality.served")
declare("served_prefix", True, "fraction", "leading greedy tokens the candidate's server, under concurrent load, "
        "shares with the baseline, as a fraction of the tokens asked for", "quality", "evaluate.quality.served")


class ServedConfig(BaseModel):
    """The recipe's `evaluate.quality.served` section."""

    model_config = ConfigDict(extra="forbid")
    num_prompts: int = Field(8, ge=2, description="prompts, from evaluate.benchmark.prompts (mixed lengths)")
    max_new_tokens: int = Field(16, ge=1, description="greedy tokens compared per prompt")
    concurrency: int = Field(4, ge=2, description="requests in flight at once at the candidate's server")
    shared_prefix: int = Field(
        0, ge=0, exclude_if=lambda v: v == 0, description="tokens of one system prompt put before every recipe "
        "prompt (taken from the prompts' own text), so the server answers from its prompt cache; 0: none")


@QUALITY_EVALS.register("served", ServedConfig)
class Served(QualityEval):
    """The candidate's own `kiln serve` (its engine loaded again, by the server) under concurrent
    mixed-length requests, against the baseline one request at a time. The run's own copy of the
    candidate (the benchmark's) is closed first: the stage holds its weights once."""

    section = Field(None, description="greedy text from the candidate's kiln serve under concurrent mixed-length "
                                      "requests, against the baseline one request at a time (gate it with agreement: "
                                      "served_prefix)")
    stage = "served"
    pair = True
    metrics = ("served_match", "served_prefix")  # declared above; per prompt in its records

    def _prompts(self, given: EvalInputs) -> list[list[int]]:
        return given.prompts(self.config.num_prompts, "evaluate.quality.served.num_prompts")

    def inputs(self, given: EvalInputs) -> dict[str, Any]:
        return {"config": self.config.model_dump(mode="json"), "prompts": hash_of(self._prompts(given)),
                "shortest": SHORTEST_TEXTS}

    def run(self, given: EvalInputs, role: str, out: Path) -> dict[str, Any]:
        from kiln.engine.loader import load_engine, read_manifest

        candidate = given.dirs["candidate"]
        given.engines.keep_only("baseline")
        res = served_text(given.engines["baseline"], lambda: load_engine(candidate),
                          read_manifest(candidate)["source"]["path"], self._prompts(given), self.config)
        return res.stage_result(out, list(self.metrics))


def with_shared_prefix(prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """The prompts, each after the same `n` tokens: the prompts' own tokens, end to end, cut at `n`."""
    pool = [t for p in prompts for t in p]
    head = (pool * (n // max(len(pool), 1) + 1))[:n]
    return [head + list(p) for p in prompts]


def one_at_a_time(engine: Engine, prompts: Sequence[list[int]], n: int, cache_prompt: bool = True) -> list[list[int]]:
    """Greedy continuations with nothing batched: each request runs alone (its prefill from the engine's
    prompt cache unless `cache_prompt` is off, as the decode benchmark asks)."""
    out = []
    for p in prompts:
        engine.add(GenerationRequest(list(p), n, ignore_eos=True, cache_prompt=cache_prompt))
        tokens: list[int] = []
        while engine.has_work():
            tokens += [e.token_id for e in engine.step()]
        out.append(tokens)
        progress.advance()
    return out


def under_load(load: Callable[[], Engine], tokenizer: Path | str, prompts: Sequence[list[int]], n: int,
               concurrency: int) -> list[list[int]]:
    """Greedy continuations streamed from a real `kiln serve` of `load()`, `concurrency` in flight."""
    from kiln.engine.remote import RemoteEngine, RemoteEngineConfig
    from kiln.engine.serve.server_thread import ServerThread

    with ServerThread(load, model_name=MODEL) as server:
        client = RemoteEngine(RemoteEngineConfig(url=server.url, model=MODEL), tokenizer)
        try:
            waiting = list(enumerate(prompts))
            owner: dict[int, int] = {}  # client seq id -> prompt index
            out: list[list[int]] = [[] for _ in prompts]
            while waiting or client.has_work():
                while waiting and len(owner) < concurrency:
                    i, p = waiting.pop(0)
                    owner[client.add(GenerationRequest(list(p), n, ignore_eos=True))] = i
                for event in client.step():
                    out[owner[event.seq_id]].append(event.token_id)
                    if event.finish_reason is not None:
                        del owner[event.seq_id]
                        progress.advance()
            return out
        finally:
            client.close()


def mixed_order(prompts: Sequence[list[int]]) -> list[int]:
    """Indices alternating shortest and longest, so every group in flight mixes prompt lengths."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[k // 2] if k % 2 == 0 else order[-1 - k // 2] for k in range(len(order))]


def shared_prefix(want: Sequence, got: Sequence) -> int:
    """How many leading items (token ids, or characters of a text) `got` shares with `want`."""
    return next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))


def served_scores(want: Sequence, got: Sequence, n: int | None = None) -> tuple[float, float]:
    """One answer scored against the reference's as this check scores it: (served_prefix,
    served_match). served_prefix: the shared leading items as a fraction of `n` (the tokens asked
    for; None: the longer answer's length); served_match: 1.0 when all `n` are shared. The live
    canary check (kiln.deploy) scores mirrored answers with this too."""
    n = max(len(want), len(got)) if n is None else n
    if n == 0:
        return 1.0, 1.0
    matched = shared_prefix(want, got)
    return matched / n, float(matched == n and len(got) == n)


def served_text(reference: Engine, load: Callable[[], Engine], tokenizer: Path | str,
                prompts: Sequence[list[int]], config: ServedConfig) -> QualityResult:
    n = config.max_new_tokens
    if config.shared_prefix:  # before the shortest prompts join: those stay one token long
        prompts = with_shared_prefix(prompts, config.shared_prefix)
    prompts = with_shortest(prompts, reference.tokenizer)
    order = mixed_order(prompts)
    progress.total(2 * len(prompts), "answers")  # each prompt answered by the reference, then served
    want = one_at_a_time(reference, prompts, n)
    got_in_order = under_load(load, tokenizer, [prompts[i] for i in order], n, config.concurrency)
    got = [[] for _ in prompts]
    for i, tokens in zip(order, got_in_order, strict=True):
        got[i] = tokens
    decode = getattr(reference.tokenizer, "decode", None)
    records = []
    for i, (p, w, g) in enumerate(zip(prompts, want, got, strict=True)):
        prefix, match = served_scores(w, g, n)
        records.append({"doc_id": i, "prompt_tokens": len(p), "matched_tokens": shared_prefix(w, g),
                        "served_prefix": prefix, "served_match": match,
                        "baseline": w, "candidate": g,
                        **({"baseline_text": decode(w), "candidate_text": decode(g)} if decode else {})})
    metrics = {"served_match": sum(r["served_match"] for r in records) / len(records),
               "served_prefix": sum(r["served_prefix"] for r in records) / len(records),
               "served_prompts": float(len(records))}
    return QualityResult("served", records, metrics)
