"""llama.cpp's C API in Python: llama-cpp-python's ctypes module over this machine's libllama.so.

The build (core/llama_cpp_build.py) copies the sdist's pure-Python `llama_cpp/` package beside the
shared libraries; this loads its low-level module `llama_cpp.llama_cpp` (every C function and struct
of the vendored llama.h, written for that very version) without running the package's `__init__`,
which imports its high-level `Llama` class and that needs `diskcache`, which kiln does not install.

It lives on the shared ground because two layers call llama.cpp in-process: the gguf quantizer
(llama_model_quantize and the tokenizer check, optimize/gguf_native.py) and the llama_cpp engine
(engine/llama_cpp/binding.py, which adds the binding's `_internals` wrappers). The quantizer's calls
are the whole of what `make demo` needs from llama.cpp's programs: with them, the demo's part of the
compile is libllama alone, not the `common` library that llama-quantize and llama-tokenize link.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

from kiln.core.errors import BadInput
from kiln.core.llama_cpp_build import BINDING, library_dir


def api() -> ModuleType:
    """`llama_cpp.llama_cpp`, the ctypes declarations, loaded over this machine's libllama.so."""
    if "llama_cpp.llama_cpp" in sys.modules:
        return sys.modules["llama_cpp.llama_cpp"]
    base = library_dir()
    if base is None:
        raise BadInput("llama.cpp's shared library and Python binding are not built on this machine: run "
                       "`make llama-cpp` (or `python -m kiln.core.llama_cpp_build`) to build llama.cpp once.")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(base / "bin")  # read by llama_cpp.llama_cpp when it loads the library
    spec = importlib.machinery.ModuleSpec("llama_cpp", None, is_package=True)
    spec.submodule_search_locations = [str(base / BINDING / "llama_cpp")]
    sys.modules["llama_cpp"] = importlib.util.module_from_spec(spec)  # the package without running its __init__
    return importlib.import_module("llama_cpp.llama_cpp")
