"""llama.cpp's quantizer and tokenizer through its C API, in a child process of their own.

`python -m kiln.optimize.gguf_native quantize SRC DST TYPE [THREADS]` calls `llama_model_quantize`
with the defaults `llama-quantize SRC DST TYPE [THREADS]` uses (the same bytes: a test compares them where
the program is built), and `python -m kiln.optimize.gguf_native tokenize GGUF` reads a JSON list of
texts on stdin and writes their token ids (no BOS, special tokens not parsed), loading only the
vocabulary, as `llama-tokenize --no-bos --no-parse-special` does but for every text in one load and
without its escape processing of `\\n`-style sequences.

Why not the programs: both link llama.cpp's `common` library, a third of the compile `make demo`
waits for; the C API needs only libllama (core/llama_cpp_lib.py). Why a child process: a
vocabulary llama.cpp cannot handle aborts the process that tokenizes with it, and the optimize stage
measures its children's memory apart from its own.
"""

from __future__ import annotations

import ctypes
import json
import sys

from kiln.core.llama_cpp_lib import api


def quantize(src: str, dst: str, ftype: str, threads: int = 0) -> None:
    lib = api()
    lib.llama_backend_init()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads  # <= 0: every core, as llama-quantize without a thread count
    if lib.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {dst} as {ftype} failed")


def tokenize(gguf: str, texts: list[str]) -> list[list[int]]:
    lib = api()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(gguf.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp cannot load the vocabulary of {gguf}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        return [_ids(lib, vocab, text.encode()) for text in texts]
    finally:
        lib.llama_model_free(model)


def _ids(lib, vocab, data: bytes) -> list[int]:
    size = len(data) + 8  # a token covers at least one byte; a negative count asks for more room
    while True:
        buf = (lib.llama_token * size)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, size, False, False)
        if n >= 0:
            return list(buf[:n])
        size = -n


def main(argv: list[str]) -> None:
    if argv[:1] == ["quantize"] and len(argv) in (4, 5):
        quantize(argv[1], argv[2], argv[3], int(argv[4]) if len(argv) == 5 else 0)
    elif argv[:1] == ["tokenize"] and len(argv) == 2:
        json.dump(tokenize(argv[1], json.load(sys.stdin)), sys.stdout)
    else:
        raise SystemExit("usage: python -m kiln.optimize.gguf_native quantize SRC DST TYPE [THREADS] | tokenize GGUF")


if __name__ == "__main__":
    main(sys.argv[1:])
