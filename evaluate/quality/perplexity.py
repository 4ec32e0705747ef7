"""Perplexity on held-out text, per document, through the engine's log-likelihood scoring.

Each document's NLL and token count are kept, so the gate can compare baseline and candidate
document by document (a paired bootstrap of the perplexity ratio), not as two point estimates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.core import progress
from kiln.engine.base import Engine
from kiln.evaluate.quality.base import QualityResult

BATCH = 4


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
