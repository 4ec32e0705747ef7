"""Logits at every position from llama.cpp in-process, for the llama_cpp engine's scoring.

llama-server cannot return prompt log-likelihoods (it refuses `echo`), so kiln scores through
the library itself: the ctypes binding of llama-cpp-python (its `llama_cpp/` package, copied from
the same sdist the binaries are built from, core/llama_cpp_build.py) over the build's
`libllama.so`. A context with one output row per token (what llama-cpp-python calls `logits_all`)
decodes a group of sequences packed into one unified KV cache, each under its own sequence id,
and hands [len, vocab] logits to engine/full_logits.py like the other backends.

Only the binding's low-level modules are imported (`llama_cpp.llama_cpp`, `_internals`): the
package's `__init__` also imports its high-level `Llama` class and that needs `diskcache`, which
kiln does not install.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from kiln.engine import full_logits
from kiln.engine.base import Score
from kiln.core.errors import BadInput

GGML_TYPE = {"f32": 0, "f16": 1}  # ggml_type of the KV cache
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
_QUIET = None  # the log callback handed to llama.cpp


def binding() -> ModuleType:
    """llama-cpp-python's `_internals` module, loaded over this machine's libllama.so."""
    if "llama_cpp._internals" in sys.modules:
        return sys.modules["llama_cpp._internals"]
    from kiln.core.llama_cpp_build import BINDING, library_dir

    base = library_dir()
    if base is None:
        raise BadInput("llama.cpp's shared library and Python binding are not built on this machine: run "
                       "`make llama-cpp` (or `python -m kiln.core.llama_cpp_build`) to build llama.cpp once.")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(base / "bin")  # read by llama_cpp.llama_cpp when it loads the library
    spec = importlib.machinery.ModuleSpec("llama_cpp", None, is_package=True)
    spec.submodule_search_locations = [str(base / BINDING / "llama_cpp")]
    package = importlib.util.module_from_spec(spec)  # the package without running its __init__
    sys.modules["llama_cpp"] = package
    internals = importlib.import_module("llama_cpp._internals")
    lib = internals.llama_cpp
    global _QUIET
    _QUIET = lib.llama_log_callback(lambda level, text, data: None)  # kept referenced: llama.cpp calls it later
    lib.llama_log_set(_QUIET, None)  # llama.cpp logs every load to stderr; kiln reports its own errors
    return internals


def load_model(gguf_path: Path) -> Any:
    """The GGUF file as a llama.cpp model (`_internals.LlamaModel`), ready for contexts."""
    internals = binding()
    internals.llama_cpp.llama_backend_init()
    return internals.LlamaModel(path_model=str(gguf_path), params=internals.llama_cpp.llama_model_default_params(),
                                verbose=True)


def new_context(model: Any, n_ctx: int, n_batch: int, n_seqs: int, threads: int, cache_type: str,
                flash_attn: str) -> Any:
    """A context on `model` whose `n_seqs` sequences share one KV cache of `n_ctx` positions, decoding up
    to `n_batch` tokens a call. llama.cpp reserves an output row per sequence and aborts the process
    (GGML_ASSERT n_outputs_max) when there are more sequences than rows: callers keep n_seqs <= n_batch."""
    internals = binding()
    params = internals.llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
    params.n_seq_max, params.kv_unified = n_seqs, True
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = GGML_TYPE[cache_type]
    params.flash_attn_type = FLASH_ATTN[flash_attn]
    params.no_perf = True
    return internals.LlamaContext(model=model, params=params, verbose=True)


class LlamaLogits:
    """A llama.cpp context that returns logits for every token of packed sequences."""

    def __init__(self, model: Path | Any, n_ctx: int, n_batch: int, threads: int, cache_type: str = "f16",
                 flash_attn: str = "auto", max_seqs: int = 64):
        """`model`: a GGUF file to load, or a loaded `LlamaModel` to share (the caller keeps it)."""
        internals = binding()
        self.owns_model = isinstance(model, (str, Path))
        self.model = load_model(model) if self.owns_model else model
        n_batch = min(n_batch, n_ctx)
        max_seqs = min(max_seqs, n_batch)  # new_context: no more sequences than output rows
        self.context = new_context(self.model, n_ctx, n_batch, max_seqs, threads, cache_type, flash_attn)
        self.batch = internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=True)
        self.lib, self.n_ctx, self.n_batch, self.max_seqs = internals.llama_cpp, n_ctx, n_batch, max_seqs
        self.vocab = self.model.n_vocab()

    def __call__(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """[len(seq), vocab] float32 logits per sequence; sequences are packed max_seqs at a time."""
        out: list[np.ndarray] = []
        for start in range(0, len(seqs), self.max_seqs):
            out += self._group(seqs[start:start + self.max_seqs])
        return out

    def _group(self, seqs: list[list[int]]) -> list[np.ndarray]:
        if sum(map(len, seqs)) > self.n_ctx:
            raise BadInput(f"{sum(map(len, seqs))} tokens to score at once exceed the scoring context of "
                           f"{self.n_ctx}: raise engine.ctx_per_slot.")
        bad = [t for s in seqs for t in s if not 0 <= t < self.vocab]
        if bad:
            raise BadInput(f"token id {bad[0]} is outside the model's vocabulary of {self.vocab}.")
        self.lib.llama_memory_clear(self.context.memory, True)
        # (sequence, position, token) in order: a sequence cut between two decodes continues from the cache.
        flat = [(k, pos, t) for k, s in enumerate(seqs) for pos, t in enumerate(s)]
        rows: list[np.ndarray] = []
        for start in range(0, len(flat), self.n_batch):
            rows.append(self._decode(flat[start:start + self.n_batch]))
        logits = np.concatenate(rows)
        bounds = np.cumsum([0, *map(len, seqs)])
        return [logits[bounds[k]:bounds[k + 1]] for k in range(len(seqs))]

    def _decode(self, chunk: list[tuple[int, int, int]]) -> np.ndarray:
        b = self.batch.batch
        b.n_tokens = len(chunk)
        for j, (seq, pos, token) in enumerate(chunk):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, True
            b.seq_id[j][0] = seq
        self.context.decode(self.batch)
        logits = self.lib.llama_get_logits(self.context.ctx)  # a float*: one row per token, contiguous
        return np.ctypeslib.as_array(logits, shape=(len(chunk), self.vocab)).copy()

    def close(self) -> None:
        self.batch.close()
        self.context.close()
        if self.owns_model:
            self.model.close()


class InProcessScoring:
    """`score` and `next_token_logprobs` for both llama_cpp runtimes: a LlamaLogits context, made on
    the first scoring call (a server that only generates never pays for it). Mixed in before Engine."""

    scorer: LlamaLogits | None = None
    max_positions: int

    def _new_scorer(self) -> LlamaLogits:
        raise NotImplementedError

    def _logits(self, seqs: list[list[int]]) -> list[np.ndarray]:
        if max(map(len, seqs)) > self.max_positions:
            raise BadInput(f"A sequence of {max(map(len, seqs))} tokens to score exceeds engine.ctx_per_slot "
                           f"({self.max_positions}): raise it.")
        if self.scorer is None:
            self.scorer = self._new_scorer()
        return self.scorer(seqs)

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        return full_logits.scores(pairs, self._logits, self.max_positions)

    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        return full_logits.next_token_logprobs(ids, self._logits, self.max_positions)

    def _close_scorer(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
