"""Scoring in-process for both llama_cpp runtimes, and the engine base they share.

llama-server cannot return prompt log-likelihoods (it refuses `echo`), so kiln scores through
llama.cpp itself (llama_cpp_binding.py): a context with one output row per token (what
llama-cpp-python calls `logits_all`) decodes a group of sequences packed into one unified KV
cache, each under its own sequence id, and hands [len, vocab] logits to engine/full_logits.py
like the other backends.

`LlamaCppEngine` is what the server runtime (llama_cpp_server.py) and the library runtime
(llama_cpp_library.py) have in common: the tokenizer, manifest and positions their config gives,
and `score` / `next_token_logprobs` on a scoring context made on the first scoring call (a server
that only generates never pays for it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.core.errors import BadInput
from kiln.engine import full_logits
from kiln.engine.base import Engine, Score
from kiln.engine.llama_cpp.binding import binding, check_vocab, fill_batch, load_model, new_batch, new_context
from kiln.engine.llama_cpp.config import LlamaCppConfig


# Positions the scorer decodes a step. Its output buffer and compute graph each hold this many rows
# of logits (at a 128k vocabulary 64 rows are 33 MB, engine.batch_size's 512 are 263 MB); at 1B
# scoring was no slower at 64 than at 256 or 512 on 2 cores, and slower at 32 (docs/engines.md).
SCORING_ROWS = 64


class LlamaLogits:
    """A llama.cpp context that returns logits for every token of packed sequences."""

    def __init__(self, model: Path | Any, n_ctx: int, n_batch: int, threads: int,
                 cache_types: tuple[str, str] = ("f16", "f16"), flash_attn: str = "auto", max_seqs: int = 64):
        """`model`: a GGUF file to load, or a loaded `LlamaModel` to share (the caller keeps it)."""
        self.owns_model = isinstance(model, (str, Path))
        self.model = load_model(model) if self.owns_model else model
        n_batch = min(n_batch, n_ctx, SCORING_ROWS)
        max_seqs = min(max_seqs, n_batch)  # new_context: no more sequences than output rows
        self.context = new_context(self.model, n_ctx, n_batch, max_seqs, threads, cache_types, flash_attn)
        self.batch = new_batch(n_batch)
        self.lib, self.n_ctx, self.n_batch, self.max_seqs = binding().llama_cpp, n_ctx, n_batch, max_seqs
        self.vocab = self.model.n_vocab()

    def __call__(self, seqs: list[list[int]]) -> Iterator[np.ndarray]:
        """[len(seq), vocab] float32 logits per sequence, in order, each handed over as soon as its last
        position is decoded; sequences are packed max_seqs at a time."""
        for start in range(0, len(seqs), self.max_seqs):
            yield from self._group(seqs[start:start + self.max_seqs])

    def _group(self, seqs: list[list[int]]) -> Iterator[np.ndarray]:
        if sum(map(len, seqs)) > self.n_ctx:
            raise BadInput(f"{sum(map(len, seqs))} tokens to score at once exceed the scoring context of "
                           f"{self.n_ctx}: raise engine.ctx_per_slot.")
        check_vocab((t for s in seqs for t in s), self.vocab)
        self.lib.llama_memory_clear(self.context.memory, True)
        # (token, position, sequence, wants logits) in order: a sequence cut between two decodes continues
        # from the cache. One sequence's logits are held at a time (its rows copied in as they come), not
        # the group's: the caller reads each out before the next is filled.
        flat = [(t, pos, k, True) for k, s in enumerate(seqs) for pos, t in enumerate(s)]
        k, filled, current = 0, 0, None
        for start in range(0, len(flat), self.n_batch):
            rows = self._decode(flat[start:start + self.n_batch])
            while len(rows):
                if current is None:
                    current = np.empty((len(seqs[k]), self.vocab), dtype=np.float32)
                take = min(len(rows), len(current) - filled)
                current[filled:filled + take] = rows[:take]
                rows, filled = rows[take:], filled + take
                if filled == len(current):
                    yield current
                    current, k, filled = None, k + 1, 0  # the caller holds it now, or has let it go

    def _decode(self, chunk: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """The chunk's logits, a row per token: a view of llama.cpp's buffer, valid until the next decode."""
        fill_batch(self.batch, chunk)
        self.context.decode(self.batch)
        logits = self.lib.llama_get_logits(self.context.ctx)  # a float*: one row per token, contiguous
        return np.ctypeslib.as_array(logits, shape=(len(chunk), self.vocab))

    def close(self) -> None:
        self.batch.close()
        self.context.close()
        if self.owns_model:
            self.model.close()


class LlamaCppEngine(Engine):
    """The base of both runtimes' engines: tokenizer and manifest, and `score` / `next_token_logprobs`
    in-process. A runtime says where the scorer's model comes from (`_scoring_model`)."""

    scorer: LlamaLogits | None = None
    max_positions: int = 2048
    config: LlamaCppConfig

    def _setup(self, tokenizer_dir: Path, config: LlamaCppConfig) -> None:
        """What every runtime's engine holds: the HF tokenizer beside the GGUF, the config, the slot size."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.manifest = {"backend": "llama_cpp", "config": config.model_dump(mode="json")}
        self.config, self.max_positions = config, config.ctx_per_slot

    def _scoring_model(self) -> Path | Any:
        """The GGUF file the scorer loads, or a loaded model it shares."""
        raise NotImplementedError

    def _logits(self, seqs: list[list[int]]) -> Iterator[np.ndarray]:
        if max(map(len, seqs)) > self.max_positions:
            raise BadInput(f"A sequence of {max(map(len, seqs))} tokens to score exceeds engine.ctx_per_slot "
                           f"({self.max_positions}): raise it.")
        if self.scorer is None:
            c = self.config
            self.scorer = LlamaLogits(self._scoring_model(), c.ctx_per_slot, c.batch_size, c.thread_count(),
                                      c.kv_types(), c.flash_attn)
        return self.scorer(seqs)

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        return full_logits.scores(pairs, self._logits, self.max_positions)

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        return full_logits.next_token_logprobs(ids, self._logits, self.max_positions)

    def _close_scorer(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
