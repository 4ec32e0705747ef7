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
    prefix of a stop string that might still complete."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters already emitted
        self.text = ""
        self.stopped = False

    def push(self, token_id: int | None, final: bool = False) -> str:
        """Add a token (None: just flush); return the new text that is safe to emit."""
        if token_id is not None:
            self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped, final = self.text[: min(hits)], True, True
        safe = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # a multi-byte character still incomplete
                safe -= 1
            safe -= max((len(s) - 1 for s in self.stop), default=0)
        delta = self.text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta
