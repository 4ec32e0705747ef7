"""score() and next_token_logprobs() for backends whose runtime returns logits at every position.

OpenVINO (the stateful IR run without its KV cache) and CTranslate2 (`forward_batch`) both give
[batch, length, vocab] logits for right-padded batches. What is left is the same for both:
group sequences so one forward pass stays within a padded-token budget, turn logits into
log-probabilities in float64-safe numpy, and read out the continuation's log-likelihood.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from kiln.engine.base import Score
from kiln.core.errors import BadInput

# logits_fn(batch of token-id lists) -> [len(seq), vocab] float32 logits, one per sequence, in order: a
# list, or an iterator that hands each over as it is computed (llama.cpp's scorer)
LogitsFn = Callable[[list[list[int]]], Iterable[np.ndarray]]


# One scoring batch's float32 logits, [rows, width, vocab], at most this many bytes (OpenVINO keeps them in its
# infer request's buffer between calls). 4,096 tokens of a 49k vocabulary are 768 MiB: the demo's lm-eval
# task on OpenVINO at 135M peaked 1,152 MiB above the engine, 384 MiB under this cap, and ran no slower
# (23.4-24.2 s against 25.1-25.9, two interleaved rounds); 1B int8 perplexity, 4 x 64 tokens of 128k: peak
# 1,642 -> 1,493 MiB above the engine, 33.0-33.6 s -> 32.0-32.4 s.
LOGITS_BUDGET_BYTES = 64 << 20


def token_budget(tokens: int, vocab: int) -> int:
    """Padded tokens per scoring batch: `tokens`, fewer where their float32 logits would pass
    LOGITS_BUDGET_BYTES (a longer sequence is still scored, alone)."""
    return max(1, min(tokens, LOGITS_BUDGET_BYTES // (4 * max(vocab, 1))))


def batches(seqs: Sequence[Sequence[int]], budget_tokens: int) -> list[list[int]]:
    """Indices grouped longest-first so that (rows x longest row) stays within the budget."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and len(seqs[groups[-1][0]]) * (len(groups[-1]) + 1) <= budget_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# Rows of exp() (and of log-probabilities, where a score reads only the continuation's) made at a time: the
# temporaries beside a sequence's logits stay this size, not one or two more [len, vocab] arrays (at 1B's 128k
# vocabulary, 0.5 GiB each for 1,024 tokens).
CHUNK_BYTES = 8 << 20


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(vocab, 1)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float32 log-probabilities of [..., vocab] logits: one new array beside them, the same values as
    `shifted - log(sum(exp(shifted)))` on the whole array (each row's sum is taken alone either way)."""
    x = logits.astype(np.float32, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)
    each_row = shifted.reshape(-1, shifted.shape[-1])  # a view: one row, or many
    step = _rows_per_chunk(shifted.shape[-1])
    for at in range(0, len(each_row), step):
        rows = each_row[at:at + step]
        rows -= np.log(np.exp(rows).sum(axis=-1, keepdims=True))
    return shifted


def next_token_logprobs(ids: Sequence[list[int]], logits_fn: LogitsFn, budget_tokens: int) -> list[np.ndarray]:
    """One [len, vocab] log-distribution per sequence, computed in budget-sized batches."""
    if any(len(s) == 0 for s in ids):
        raise BadInput("next_token_logprobs() needs non-empty token sequences.")
    out: list[np.ndarray | None] = [None] * len(ids)
    for i, logits in _each_sequence(ids, logits_fn, budget_tokens):
        out[i] = log_softmax(logits)
    return out  # type: ignore[return-value]


def _each_sequence(ids: Sequence[Sequence[int]], logits_fn: LogitsFn,
                   budget_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
    """(index, [len, vocab] logits) of every sequence, a budget-sized batch at a time: only one
    batch's logits need be held at once."""
    for group in batches(ids, budget_tokens):
        # Not zip(): its reused result tuple would hold the last sequence's logits while the next is made.
        handed = iter(logits_fn([list(ids[i]) for i in group]))
        for i in group:
            yield i, next(handed)


def scores(pairs: Sequence[tuple[list[int], list[int]]], logits_fn: LogitsFn, budget_tokens: int) -> list[Score]:
    """Log-likelihood of each continuation given its context, from full-position logits."""
    if any(not ctx or not cont for ctx, cont in pairs):
        raise BadInput("score() needs a non-empty context and continuation in every pair "
                       "(lm-eval passes the EOT token as context for rolling log-likelihoods).")
    # The last continuation token predicts nothing we need, so it is never fed.
    inputs = [list(ctx) + list(cont)[:-1] for ctx, cont in pairs]
    results: list[Score | None] = [None] * len(pairs)
    # A batch's scores are read out as it comes: one batch's logits are held at a time, not every
    # sequence's [len, vocab] log-probabilities at once (1 GB for 2,048 tokens of a 128k vocabulary).
    for i, logits in _each_sequence(inputs, logits_fn, budget_tokens):
        ctx, cont = pairs[i]
        results[i] = _continuation(logits[len(ctx) - 1 :], np.asarray(cont))  # row j predicts cont[j]
        del logits  # a streaming logits_fn then fills the next sequence without this one beside it
    return results  # type: ignore[return-value]


def _continuation(predicting: np.ndarray, target: np.ndarray) -> Score:
    """The Score of `target` from the logits that predict it, a chunk of rows' log-probabilities at a time."""
    step = _rows_per_chunk(predicting.shape[-1])
    lps, greedy = [], True
    for at in range(0, len(target), step):
        lp, want = log_softmax(predicting[at:at + step]), target[at:at + step]
        lps.append(lp[np.arange(len(want)), want])
        greedy = greedy and bool((lp.argmax(axis=-1) == want).all())
    each = np.concatenate(lps)
    return Score(float(each.sum()), greedy, tuple(float(x) for x in each))


def right_padded(seqs: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ids and attention mask of `seqs` padded on the right (causal: padding is inert)."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask
