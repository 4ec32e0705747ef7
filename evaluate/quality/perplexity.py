"""Perplexity on held-out text, per document, through the engine's log-likelihood scoring.

Each document's NLL and token count are kept, so the gate can compare baseline and candidate
document by document (a paired bootstrap of the perplexity ratio), not as two point estimates.
The recipe's `evaluate.quality.perplexity` names the held-out text and how it is cut: the
documents every eval that reads text scores (token agreement too), so it is always set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.core import progress
from kiln.engine.base import Engine
from kiln.evaluate.quality.base import QUALITY_EVALS, EvalInputs, QualityEval, QualityResult

BATCH = 4


# The recipe's `evaluate.quality.perplexity` section (no docstring: `kiln schema` shows none for it).
class PerplexityConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = Field("demo", description="'demo' (held-out Austen) or a local .txt file")
    max_documents: int = Field(24, ge=1, description="documents (windows) scored per model")
    seq_len: int = Field(256, ge=16, description="tokens per document")


@QUALITY_EVALS.register("perplexity", PerplexityConfig)
class Perplexity(QualityEval):
    """Each arm alone, on the held-out documents."""

    section = Field(PerplexityConfig())
    stage, phase = "quality", "quality"  # a stage's name is part of its key: "quality", as before the registry
    metrics = ("perplexity",)  # declared in kiln.core.metrics: the gate's quality check judges it from nll and tokens

    def inputs(self, given: EvalInputs) -> dict[str, Any]:
        return {**given.documents()[1], "eval": "perplexity"}

    def run(self, given: EvalInputs, role: str, out: Path) -> dict[str, Any]:
        return perplexity(given.engines[role], given.documents()[0]).stage_result(out, ["nll", "tokens"])


def perplexity(engine: Engine, docs: Sequence[list[int]]) -> QualityResult:
    records = []
    progress.total(len(docs), "documents")
    for start in range(0, len(docs), BATCH):
        batch = docs[start:start + BATCH]
        scores = engine.score([(d[:1], d[1:]) for d in batch])
        for i, (doc, s) in enumerate(zip(batch, scores, strict=True)):
            records.append({"doc_id": start + i, "nll": -s.logprob, "tokens": len(doc) - 1})
        progress.advance(len(batch))
    nll = sum(r["nll"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return QualityResult("perplexity", records, {"perplexity": math.exp(nll / tokens), "nll_per_token": nll / tokens,
                                                 "documents": len(records), "tokens": tokens})
