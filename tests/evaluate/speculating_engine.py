"""A test engine that speculates the way llama.cpp does, over the torch engine's model, with an
acceptance rule that can be wrong: the lossless check must tell the two rules apart.

Each step a drafter proposes every sequence's next token and the model verifies it: the draft is kept
when the rule accepts it, else the model's own argmax is written. The drafter is wrong on purpose at
generated position `wrong_at` (it proposes the model's runner-up). `strict` (what speculative decoding
claims): only the argmax is accepted, so the text is the model's greedy text whatever the drafter
proposes. Lenient: any of the model's top two is accepted, so the wrong draft is written and becomes
the context of every token after it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.engine.base import Engine, GenerationRequest, Score, TokenEvent, check_request


class SpeculatingEngine(Engine):
    def __init__(self, model: Engine, strict: bool, wrong_at: int = 2, owns_model: bool = False):
        self.model, self.strict, self.wrong_at, self.owns_model = model, strict, wrong_at, owns_model
        self.tokenizer, self.manifest = model.tokenizer, {"backend": "speculating-test"}
        self._seqs: dict[int, tuple[list[int], list[int], int]] = {}  # id -> (prompt, written, max_new_tokens)
        self._next = 0
        self.drafts_rejected = 0

    def add(self, request: GenerationRequest) -> int:
        check_request(request, 1024)
        self._next += 1
        self._seqs[self._next] = (list(request.prompt_ids), [], request.max_new_tokens)
        return self._next

    def step(self) -> list[TokenEvent]:
        events = []
        for sid, (prompt, written, n) in list(self._seqs.items()):
            logprobs = np.asarray(self.model.next_token_logprobs([prompt + written])[0][-1])
            best, runner_up = (int(t) for t in np.argsort(logprobs)[::-1][:2])
            draft = runner_up if len(written) == self.wrong_at else best
            accepted = draft == best or (not self.strict and draft == runner_up)
            self.drafts_rejected += not accepted
            written.append(draft if accepted else best)
            finish = "length" if len(written) == n else None
            events.append(TokenEvent(sid, written[-1], time.perf_counter(), finish_reason=finish))
            if finish:
                del self._seqs[sid]
        return events

    def cancel(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def has_work(self) -> bool:
        return bool(self._seqs)

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        return self.model.score(pairs)

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        return self.model.next_token_logprobs(ids)

    def close(self) -> None:
        if self.owns_model:
            self.model.close()
