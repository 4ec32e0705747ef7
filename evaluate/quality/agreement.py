"""Token-level agreement with the baseline: the most sensitive cheap signal of quantization damage.

Position by position on held-out text, compare the candidate's next-token distribution with the
baseline's: KL(baseline || candidate), and whether their top-1 tokens agree, averaged over each
document's positions and then over documents (every document weighs the same, whatever its
length). Then greedy continuations from each document's opening: does the candidate write exactly
what the baseline writes?
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from kiln.core import progress
from kiln.engine.base import Engine, GenerationRequest
from kiln.evaluate.quality.base import QUALITY_EVALS, EvalInputs, QualityEval, QualityResult

PROMPT_TOKENS = 32
CONTINUATION_TOKENS = 16


@QUALITY_EVALS.register("agreement", bool)  # type: ignore[arg-type] - its section is a switch, no config
class Agreement(QualityEval):
    """The candidate against the baseline, on the held-out documents perplexity scores."""

    section = Field(True, description="token-level agreement (KL, top-1) with the baseline")
    stage = phase = "agreement"
    pair = True
    # declared in kiln.core.metrics (AGREEMENT), where the gate finds them with no eval imported; per document
    metrics = ("kl_mean", "kl_p99", "top1_agreement", "greedy_match")

    def inputs(self, given: EvalInputs) -> dict[str, Any]:
        return given.documents()[1]

    def run(self, given: EvalInputs, role: str, out: Path) -> dict[str, Any]:
        res = agreement(given.engines["baseline"], given.engines["candidate"], given.documents()[0])
        return res.stage_result(out, list(self.metrics))


def _kl_and_top1(base: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per position KL(base || cand) and top-1 agreement, from [positions, vocab] log-probs.
    Elementwise in float32 (half the memory traffic of float64 over a 49k vocab), summed in float64."""
    p = np.exp(base)
    kl = (p * (base - cand)).sum(axis=-1, dtype=np.float64)
    return np.maximum(kl, 0.0), base.argmax(-1) == cand.argmax(-1)


def agreement(baseline: Engine, candidate: Engine, docs: Sequence[list[int]]) -> QualityResult:
    records = []
    all_kl = []
    progress.total(len(docs), "documents")  # the greedy continuations after them are one batch per arm
    for i, doc in enumerate(docs):
        b = np.asarray(baseline.next_token_logprobs([doc])[0], dtype=np.float32)
        c = np.asarray(candidate.next_token_logprobs([doc])[0], dtype=np.float32)
        kl, top1 = _kl_and_top1(b, c)
        all_kl.append(kl)
        records.append({"doc_id": i, "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
                        "top1_agreement": float(top1.mean()), "positions": len(kl)})
        progress.advance()
    prompts = [d[:PROMPT_TOKENS] for d in docs]
    for rec, b, c in zip(records, generate_greedy(baseline, prompts), generate_greedy(candidate, prompts), strict=True):
        rec["greedy_match"] = float(b == c)
    # kl_mean and top1_agreement are means of the per-document values, the unit the gate's
    # agreement check bootstraps over, so the figure shown is the figure checked. kl_p99 is the
    # tail of every position pooled (a mean of per-document 99th percentiles is no percentile).
    kl = np.concatenate(all_kl)
    metrics = {"kl_mean": float(np.mean([r["kl_mean"] for r in records])), "kl_p99": float(np.quantile(kl, 0.99)),
               "top1_agreement": float(np.mean([r["top1_agreement"] for r in records])),
               "greedy_match": float(np.mean([r["greedy_match"] for r in records]))}
    return QualityResult("agreement", records, metrics)


def generate_greedy(engine: Engine, prompts: Sequence[list[int]]) -> list[list[int]]:
    """Greedy continuations, in prompt order (seq ids map back through `add`'s return)."""
    ids = [engine.add(GenerationRequest(p, CONTINUATION_TOKENS, ignore_eos=True)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    return [out[i] for i in ids]
