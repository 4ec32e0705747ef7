"""llama.cpp in kiln's process: the Python binding, a model, a context and a batch to decode.

Both llama_cpp runtimes reach llama.cpp through this module when they run it in-process: the
library runtime (llama_cpp_library.py) to generate, either runtime to score
(llama_cpp_scoring.py). The binding is the ctypes one of llama-cpp-python (its `llama_cpp/`
package, copied from the same sdist the binaries are built from, core/llama_cpp_build.py) over
the build's `libllama.so`.

Only the binding's low-level modules are imported: `llama_cpp.llama_cpp`, the C API, loaded by
core/llama_cpp_lib.py (the gguf quantizer calls it too), and `_internals`, its wrappers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.core.errors import BadInput
from kiln.engine.llama_cpp.config import KV_GGML_TYPE
from kiln.engine.mapped_pages import drop_behind

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
_QUIET = None  # the log callback handed to llama.cpp


def binding() -> ModuleType:
    """llama-cpp-python's `_internals` module, loaded over this machine's libllama.so."""
    if "llama_cpp._internals" in sys.modules:
        return sys.modules["llama_cpp._internals"]
    from kiln.core.llama_cpp_lib import api

    lib = api()
    internals = importlib.import_module("llama_cpp._internals")
    global _QUIET
    _QUIET = lib.llama_log_callback(lambda level, text, data: None)  # kept referenced: llama.cpp calls it later
    lib.llama_log_set(_QUIET, None)  # llama.cpp logs every load to stderr; kiln reports its own errors
    return internals


def load_model(gguf_path: Path) -> Any:
    """The GGUF file as a llama.cpp model (`_internals.LlamaModel`), ready for contexts."""
    internals = binding()
    internals.llama_cpp.llama_backend_init()
    with drop_behind(gguf_path):  # the tensors it repacks at load (Q4_K) are not held twice (mapped_pages.py)
        return internals.LlamaModel(path_model=str(gguf_path), params=internals.llama_cpp.llama_model_default_params(),
                                    verbose=True)


def new_context(model: Any, n_ctx: int, n_batch: int, n_seqs: int, threads: int, cache_types: tuple[str, str],
                flash_attn: str) -> Any:
    """A context on `model` whose `n_seqs` sequences share one KV cache of `n_ctx` positions (K and V of
    `cache_types`: LlamaCppConfig.kv_types), decoding up to `n_batch` tokens a call. llama.cpp reserves an
    output row per sequence and aborts the process (GGML_ASSERT n_outputs_max) when there are more
    sequences than rows: callers keep n_seqs <= n_batch."""
    internals = binding()
    params = internals.llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
    params.n_seq_max, params.kv_unified = n_seqs, True
    params.n_threads = params.n_threads_batch = threads
    params.type_k, params.type_v = (KV_GGML_TYPE[t] for t in cache_types)
    params.flash_attn_type = FLASH_ATTN[flash_attn]
    params.no_perf = True
    return internals.LlamaContext(model=model, params=params, verbose=True)


def new_batch(n_tokens: int) -> Any:
    """A batch (`_internals.LlamaBatch`) of up to `n_tokens` tokens, one sequence id each."""
    return binding().LlamaBatch(n_tokens=n_tokens, embd=0, n_seq_max=1, verbose=True)


def fill_batch(batch: Any, rows: Sequence[tuple[int, int, int, bool]]) -> None:
    """Put the next decode's tokens into `batch`: one (token, position, sequence id, wants logits) a row."""
    b = batch.batch
    b.n_tokens = len(rows)
    for j, (token, pos, seq, wants) in enumerate(rows):
        b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, wants
        b.seq_id[j][0] = seq


def check_vocab(ids: Iterable[int], vocab: int) -> None:
    """Refuse a token id outside the model's vocabulary before it reaches llama.cpp: in a batch shared
    with other sequences, one bad id would fail them all."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadInput(f"token id {bad} is outside the model's vocabulary of {vocab}.")
