"""engine/full_logits.py: scores read out of a logits function that hands sequences over one at a time."""

from __future__ import annotations

import tracemalloc
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


def test_log_softmax_takes_its_sums_a_chunk_of_rows_at_a_time_and_gives_the_same_values(monkeypatch):
    """Row sums taken a few rows at a time give exactly what one pass over the whole array gives."""
    logits = np.random.default_rng(1).standard_normal((37, 1000)).astype(np.float32) * 8
    shifted = logits - logits.max(axis=-1, keepdims=True)
    want = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    monkeypatch.setattr(full_logits, "CHUNK_BYTES", 5 * 1000 * 4)  # 5 rows a chunk: 7 full chunks and a short one
    assert np.array_equal(full_logits.log_softmax(logits), want)
    assert np.array_equal(full_logits.log_softmax(logits[3]), want[3])  # one row (a sampled token's log-prob)
    assert np.array_equal(full_logits.log_softmax(logits.astype(np.float16)), full_logits.log_softmax(
        logits.astype(np.float16).astype(np.float32)))


def test_a_score_holds_no_more_than_a_chunk_beside_the_sequences_logits():
    """A 1,024-token continuation of a 32k vocabulary is 128 MiB of logits: reading its score out makes a chunk
    of log-probabilities at a time, not the continuation's [len, vocab] log-probabilities (and exp()'s) beside
    them. The score is the one the whole log-softmax gives."""
    rng = np.random.default_rng(2)
    length, vocab = 1024, 32_000
    logits = rng.standard_normal((length + 1, vocab)).astype(np.float32)
    pair = ([1, 2], logits[1:].argmax(axis=-1).tolist())  # the greedy continuation
    tracemalloc.start()
    try:
        got = full_logits.scores([pair], lambda seqs: [logits], budget_tokens=4096)[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * full_logits.CHUNK_BYTES, peak
    whole = full_logits.log_softmax(logits[1:])[np.arange(length), pair[1]]
    assert got.token_logprobs == tuple(float(x) for x in whole) and got.logprob == float(whole.sum())
    assert got.is_greedy
    pair[1][-1] = (pair[1][-1] + 1) % vocab  # one token off, in the last chunk
    assert not full_logits.scores([pair], lambda seqs: [logits], budget_tokens=4096)[0].is_greedy
