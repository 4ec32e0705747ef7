"""Test-only engines that decode wrongly only when batched, as CTranslate2's cohorts did.

`BatchBrokenEngine` (issue #18): exact when it holds one request; while two or more share it, every
token it reports is off by one. `ShortPromptBrokenEngine` (issue 39): wrong only beside a one-token
prompt. The served-text check and the build parity smoke check must catch both.
"""

from __future__ import annotations

import dataclasses

from kiln.engine.hf_torch import TorchEngine


class BatchBrokenEngine(TorchEngine):
    crowded_steps = 0  # steps taken with more than one request in the engine

    def step(self):
        crowded = len(self._batch) + len(self._pending) > 1
        self.crowded_steps += crowded
        events = super().step()
        if not crowded:
            return events
        return [dataclasses.replace(e, token_id=(e.token_id + 1) % self.vocab_size) for e in events]


class ShortPromptBrokenEngine(TorchEngine):
    """Exact, batched or alone, until a one-token prompt shares it with longer ones: then every
    other sequence's tokens are off by one (CTranslate2 4.8.5 streamed their prompts' tails, issue 39)."""

    def step(self):
        seqs = self._batch + self._pending
        short = {s.id for s in seqs if len(s.req.prompt_ids) == 1}
        events = super().step()
        if not short or len(short) == len(seqs):
            return events
        return [e if e.seq_id in short else dataclasses.replace(e, token_id=(e.token_id + 1) % self.vocab_size)
                for e in events]
