"""Token agreement's aggregates weigh every document the same, as the gate's check does (issue #18)."""

import numpy as np
import pytest

from kiln.engine.base import TokenEvent
from kiln.evaluate.quality.agreement import agreement

VOCAB = 8


class ScriptedEngine:
    """Next-token log-probs chosen per document (its top-1 token at every position given by
    `top1(doc)`), and greedy generation that emits token 1 forever: enough for `agreement`."""

    def __init__(self, top1):
        self.top1, self.queue, self.next_id = top1, {}, 0

    def next_token_logprobs(self, ids):
        out = []
        for doc in ids:
            logits = np.zeros((len(doc), VOCAB))
            logits[np.arange(len(doc)), self.top1(doc)] = 3.0
            out.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
        return out

    def add(self, request):
        self.next_id += 1
        self.queue[self.next_id] = request.max_new_tokens
        return self.next_id

    def has_work(self):
        return bool(self.queue)

    def step(self):
        events = [TokenEvent(seq_id, 1, 0.0) for seq_id in self.queue]
        self.queue = {k: v - 1 for k, v in self.queue.items() if v > 1}
        return events


def test_top1_and_kl_are_means_over_documents_not_positions():
    short, long = list(range(40, 44)), list(range(100, 140))  # 4 and 40 positions
    baseline = ScriptedEngine(lambda doc: np.zeros(len(doc), int))
    # The candidate disagrees on every position of the short document and agrees on the long one.
    candidate = ScriptedEngine(lambda doc: np.full(len(doc), 2 if len(doc) == 4 else 0))
    res = agreement(baseline, candidate, [short, long])
    per_doc = {r["doc_id"]: r for r in res.records}
    assert (per_doc[0]["top1_agreement"], per_doc[1]["top1_agreement"]) == (0.0, 1.0)
    assert res.metrics["top1_agreement"] == pytest.approx(0.5)  # pooled over positions it would be 40/44
    assert per_doc[1]["kl_mean"] == pytest.approx(0.0, abs=1e-9) and per_doc[0]["kl_mean"] > 0
    assert res.metrics["kl_mean"] == pytest.approx(per_doc[0]["kl_mean"] / 2)  # pooled: 4/44 of it
