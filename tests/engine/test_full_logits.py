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


def test_a_scoring_batch_keeps_its_float32_logits_within_the_budget():
    """4,096 padded tokens of a 49,152-token vocabulary would be 768 MiB of logits: 341 tokens are 64 MiB.
    A small vocabulary keeps the token budget; a sequence longer than the budget is still scored, alone."""
    assert full_logits.token_budget(4096, 49152) == 341
    assert 341 * 49152 * 4 <= full_logits.LOGITS_BUDGET_BYTES < 342 * 49152 * 4
    assert full_logits.token_budget(4096, 128256) == 130
    assert full_logits.token_budget(4096, 50) == 4096
    assert full_logits.token_budget(4096, 1 << 40) == 1
    assert full_logits.batches([[1] * 200, [2] * 100, [3] * 30, [4] * 30], 130) == [[0], [1], [2, 3]]
