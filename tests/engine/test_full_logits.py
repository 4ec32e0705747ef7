"""engine/full_logits.py: scores read out of a logits function that hands sequences over one at a time."""

from __future__ import annotations

import weakref

import numpy as np

from kiln.engine import full_logits


def test_scores_let_each_sequence_go_before_the_next_is_filled():
    """With a streaming logits function (llama.cpp's scorer), scores() holds one sequence's logits at
    a time: the one before is gone when the next is made. The scores are those of the whole logits."""
    rng = np.random.default_rng(0)
    vocab, alive = 50, []
    pairs = [([1, 2], [3, 4, 5]), ([6], [7]), ([8, 9, 10], [11, 12])]

    def streaming(seqs):
        for s in seqs:
            alive.append(sum(r() is not None for r in refs))  # earlier sequences' logits still held
            logits = rng.standard_normal((len(s), vocab)).astype(np.float32)
            kept.append(logits.copy())
            refs.append(weakref.ref(logits))
            yield logits
            del logits

    refs, kept = [], []
    got = full_logits.scores(pairs, streaming, budget_tokens=100)
    assert alive == [0, 0, 0]
    # the same logits as a list, held all at once: the same scores
    want = full_logits.scores(pairs, lambda seqs: [kept.pop(0) for _ in seqs], budget_tokens=100)
    assert [g.logprob for g in got] == [w.logprob for w in want]
    assert [g.token_logprobs for g in got] == [w.token_logprobs for w in want]
