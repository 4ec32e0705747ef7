"""A test-only engine that decodes wrongly only when batched: what CTranslate2's cohorts did (issue #18).

Exact when it holds one request; while two or more share it, every token it reports is off by one.
The served-text check and the build parity smoke check must both catch it.
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
