"""The `llama_cpp` engine's `library` runtime: llama.cpp in kiln's own process, batched by kiln.

The `server` runtime (llama_cpp_server.py) hands generation to a `llama-server` process and reads its
token streams over HTTP; on a machine whose cores llama.cpp's threads fill, every hop a token
takes there (llama-server's sampler and HTTP thread, a socket, kiln's parser) runs on a core a
decode thread needs: driven directly, that engine decodes at batch 1 at 0.86-0.96x `llama-bench` on
2 cores, this one at 0.95-0.99x (bench/llama_cpp_runtimes.py, docs/engines.md). Here the decode loop is kiln's: one
llama.cpp context through the ctypes binding (the same build and binding the scorer uses,
llama_cpp_binding.py), stepped by the scheduler thread, llama.cpp's threads computing while the
ctypes call has released the GIL.

Continuous batching as llama-server does it: `parallel` sequence slots share one unified KV cache of
`parallel x ctx_per_slot` positions; every `step` is one `llama_decode` of a batch that holds each
running sequence's next token and, within `batch_size`, the next chunk of prompts waiting to be
prefilled. A request added while others decode joins at the next step; one beyond the slots waits
for a free slot, in order. Sampling is kiln's (the argmax, or temperature then top-p from a seeded
generator), on the logit row llama.cpp returns for that sequence. A sequence stops at a stop id, at
one of the model's end-of-generation tokens (llama.cpp's own list, as llama-server uses) unless
`ignore_eos`, at max_new_tokens, or when prompt and answer fill its slot's `ctx_per_slot`
positions. No prompt prefix is reused between requests (`cache_prompt` is the server runtime's).
Scoring shares the loaded model (a second context, llama_cpp_scoring.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.engine import full_logits
from kiln.engine.base import GenerationRequest, TokenEvent, check_request
from kiln.engine.llama_cpp.binding import binding, check_vocab, fill_batch, load_model, new_batch, new_context
from kiln.engine.llama_cpp.config import LlamaCppConfig
from kiln.engine.llama_cpp.scoring import LlamaCppEngine


@dataclass
class _Seq:
    seq_id: int
    request: GenerationRequest
    rng: np.random.Generator | None
    slot: int = -1
    pending: list[int] = field(default_factory=list)  # tokens to decode before the next sample
    pos: int = 0  # the position the next decoded token takes
    produced: int = 0


class LlamaLibraryEngine(LlamaCppEngine):
    """Generation and scoring in this process; `step` decodes (the scheduler thread calls it)."""

    def __init__(self, gguf_path: Path, tokenizer_dir: Path, config: LlamaCppConfig):
        lib = self.lib = binding().llama_cpp
        self._setup(tokenizer_dir, config)
        self.model = load_model(gguf_path)
        self._context: Any = None  # the generation context and its KV cache: made on the first decode
        self.capacity = config.batch_size + config.parallel  # every running sequence's token plus a prefill chunk
        self.batch = new_batch(self.capacity)
        self.vocab = self.model.n_vocab()
        self.eog = frozenset(t for t in range(self.vocab) if lib.llama_vocab_is_eog(self.model.vocab, t))
        self._ids = itertools.count()
        self._waiting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._free = list(range(config.parallel - 1, -1, -1))  # slots (llama.cpp sequence ids), popped from the end

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def context(self) -> Any:
        """The generation context, whose KV cache holds every slot (parallel x ctx_per_slot tokens):
        made on first use, so an engine that only scores (a quality stage) never allocates it."""
        if self._context is None:
            c = self.config
            self._context = new_context(self.model, c.parallel * c.ctx_per_slot, self.capacity, c.parallel,
                                        c.thread_count(), c.kv_types(), c.flash_attn)
        return self._context

    # ----- generation -----------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> int:
        check_request(request, self.max_positions)
        check_vocab(request.prompt_ids, self.vocab)
        rng = None
        if request.temperature > 0:
            rng = np.random.default_rng(request.seed)  # None: fresh entropy
        seq = _Seq(next(self._ids), request, rng, pending=list(request.prompt_ids))
        self._waiting.append(seq)
        return seq.seq_id

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def cancel(self, seq_id: int) -> None:
        seq = self._running.pop(seq_id, None)
        if seq is not None:
            self._release(seq)
            return
        self._waiting = deque(s for s in self._waiting if s.seq_id != seq_id)

    def _release(self, seq: _Seq) -> None:
        self.lib.llama_memory_seq_rm(self.context.memory, seq.slot, -1, -1)
        self._free.append(seq.slot)

    def step(self) -> list[TokenEvent]:
        """One llama_decode: each running sequence's next token, then prompt chunks within batch_size."""
        while self._waiting and self._free:
            seq = self._waiting.popleft()
            seq.slot = self._free.pop()
            self._running[seq.seq_id] = seq
        decoding = [s for s in self._running.values() if s.produced]
        prefilling = [s for s in self._running.values() if not s.produced]
        entries: list[tuple[_Seq, int, bool]] = []  # (sequence, token, wants logits)
        for seq in decoding:
            entries.append((seq, seq.pending.pop(), True))
        budget = self.config.batch_size
        for seq in prefilling:
            if budget <= 0:
                break
            chunk, seq.pending = seq.pending[:budget], seq.pending[budget:]
            budget -= len(chunk)
            entries += [(seq, t, not seq.pending and k == len(chunk) - 1) for k, t in enumerate(chunk)]
        if not entries:
            return []
        self._decode(entries)
        now = time.perf_counter()
        events: list[TokenEvent] = []
        for i, (seq, _, wants) in enumerate(entries):
            if wants:
                events.append(self._sample(seq, i, now))
        return events

    def _decode(self, entries: list[tuple[_Seq, int, bool]]) -> None:
        rows = []
        for seq, token, wants in entries:  # each token takes its sequence's next position
            rows.append((token, seq.pos, seq.slot, wants))
            seq.pos += 1
        fill_batch(self.batch, rows)
        code = self.lib.llama_decode(self.context.ctx, self.batch.batch)
        if code != 0:  # 1: no room in the KV cache (cannot happen within the slots' budget); < 0: an error
            for seq_id in {seq.seq_id for seq, _, _ in entries}:
                self.cancel(seq_id)
            raise RuntimeError(f"llama_decode returned {code} for a batch of {len(entries)} tokens")

    def _sample(self, seq: _Seq, row: int, now: float) -> TokenEvent:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.context.ctx, row), shape=(self.vocab,))
        r = seq.request
        token = int(logits.argmax()) if seq.rng is None else _draw(logits, r.temperature, r.top_p, seq.rng)
        logprob = float(full_logits.log_softmax(logits)[token]) if r.logprobs else None
        seq.produced += 1
        finish = None
        if token in r.stop_ids or (token in self.eog and not r.ignore_eos):
            finish = "stop"
        elif seq.produced >= r.max_new_tokens or seq.pos + 1 >= self.max_positions:  # prompt + answer fill the slot
            finish = "length"
        if finish:
            self._running.pop(seq.seq_id)
            self._release(seq)
        else:
            seq.pending.append(token)
        return TokenEvent(seq.seq_id, token, now, logprob, finish)

    # ----- scoring (LlamaCppEngine) ---------------------------------------------------------

    def _scoring_model(self) -> Any:
        return self.model  # shared: the scorer is a second context on it

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
        self._close_scorer()
        self.batch.close()
        if self._context is not None:
            self._context.close()
        self.model.close()


def _draw(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Temperature, then the nucleus (the smallest set of most likely tokens with mass top_p), then a draw."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        ranked = p[order]
        keep = max(1, int(np.searchsorted(np.cumsum(ranked) - ranked, top_p, side="left")))
        return int(order[rng.choice(keep, p=ranked[:keep] / ranked[:keep].sum())])
    return int(rng.choice(len(p), p=p))
