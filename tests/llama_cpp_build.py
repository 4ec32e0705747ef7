"""Shared by the llama.cpp tests: the build `make test` makes (`make llama-cpp`), or a clear stop.

A missing build fails the test, never skips it: `make test` always builds it first, so its
absence is a broken install (the failure names the command that builds it).
"""

from __future__ import annotations

import pytest


def require_llama_cpp() -> None:
    from kiln.core.llama_cpp_build import LIBRARY, TARGETS, binary, converter, install_dir, library_dir

    missing = [n for n in TARGETS if binary(n) is None]  # what `make llama-cpp` builds, no more
    if converter() is None:
        missing.append("convert_hf_to_gguf.py")
    if library_dir() is None:
        missing.append(f"{LIBRARY} and the llama_cpp binding")
    if not missing:
        return
    message = (f"llama.cpp is not built at {install_dir()} (missing {', '.join(missing)}): "
               "run `make llama-cpp` (python -m kiln.core.llama_cpp_build) with the same KILN_CACHE")
    pytest.fail(message)
