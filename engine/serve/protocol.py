"""OpenAI response pieces for the server: logprobs blocks and incremental detokenization.

Requests are parsed and validated in request.py, before they reach the scheduler.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def token_text(tokenizer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


Positions = list[tuple[float, list[tuple[int, float]]]]  # per token after the first: (logprob, top-k)


def position_logprobs(engine, seqs: list[list[int]], top: int, budget_tokens: int = 2048) -> list[Positions]:
    """For each sequence, the logprob of every token after the first and the top-k alternatives.

    Runs on the scheduler thread. Full [len, vocab] distributions are reduced to top-k chunk by
    chunk, so a batch of long prompts never holds all its distributions at once.
    """
    out: list[Positions] = [[] for _ in seqs]
    todo = [i for i, s in enumerate(seqs) if len(s) > 1]
    while todo:
        chunk, used = [], 0
        while todo and (not chunk or used + len(seqs[todo[0]]) <= budget_tokens):
            used += len(seqs[todo[0]])
            chunk.append(todo.pop(0))
        for i, rows in zip(chunk, engine.next_token_logprobs([seqs[i][:-1] for i in chunk]), strict=True):
            ids = seqs[i]
            best = np.argpartition(-rows, top - 1, axis=1)[:, :top] if top else None
            out[i] = [(float(rows[k, ids[k + 1]]),
                       [(int(t), float(rows[k, t])) for t in best[k]] if top else [])
                      for k in range(len(ids) - 1)]
    return out


def logprobs_block(tokenizer, ids: list[int], positions: Positions, first: int, top: int,
                   as_ids: bool) -> dict[str, Any]:
    """OpenAI completions `logprobs` for ids[first:]; position 0 has no prediction (null)."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    for i, token in enumerate(ids):
        piece = tokenizer.decode([token])
        if i >= first:
            tokens.append(token_text(tokenizer, token, as_ids))
            offsets.append(offset)
            lp, best = positions[i - 1] if i > 0 else (None, None)
            lps.append(lp)
            tops.append({token_text(tokenizer, t, as_ids): v for t, v in best} if best is not None else None)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if top else None,
            "text_offset": offsets}


class TextStream:
    """Incremental detokenization with stop strings, never emitting half a character or a
    prefix of a stop string that might still complete.

    Each token decodes a short window of ids, not the whole text, so a token costs the same at
    the 1000th as at the 10th. The window starts one token before the last settled point (no
    incomplete character at its end): the text of the tokens after it is what the whole text has
    there (SentencePiece decoders strip the leading space of the first token only, byte-level
    BPE decodes bytes in order), and what the window's text already held is never taken twice.
    The emitted deltas equal those of decoding the whole text every token
    (tests/engine/test_protocol.py checks this against that reference on the demo tokenizer).
    """

    WINDOW = 8  # tokens in the window before it moves up

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) - 1 for s in stop), default=0)  # a stop string's prefix may end the text
        self.special = set(tokenizer.all_special_ids)  # never the window's first token (skipped, no context)
        self.ids: list[int] = []
        self.stopped = False
        self._start = 0  # the window is ids[_start:]
        self._taken = 0  # characters of the window's text already moved to _pending
        self._pending = ""  # text decoded, not yet emitted: the last `hold` characters at most, a stop's prefix

    def push(self, token_id: int | None, final: bool = False) -> str:
        """Add a token (None: just flush); return the new text that is safe to emit."""
        if self.stopped:
            return ""
        if token_id is not None:
            self.ids.append(token_id)
        window = self.tokenizer.decode(self.ids[self._start :], skip_special_tokens=True)
        complete = not window.endswith("\ufffd")  # else a multi-byte character may be incomplete
        end = len(window) if complete or final else len(window) - 1
        if end > self._taken:
            self._pending += window[self._taken : end]
            self._taken = end
        # A stop string starts in the pending text: the emitted text stops `hold` characters before the end.
        hits = [i for i in (self._pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            self._pending, self.stopped, final = self._pending[: min(hits)], True, True
        safe = len(self._pending) if final else max(len(self._pending) - self.hold, 0)
        delta, self._pending = self._pending[:safe], self._pending[safe:]
        if complete and len(self.ids) - self._start > self.WINDOW and self.ids[-1] not in self.special:
            self._start = len(self.ids) - 1
            self._taken = len(self.tokenizer.decode(self.ids[-1:], skip_special_tokens=True))
        return delta
