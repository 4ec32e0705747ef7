"""The llama.cpp build in two parts, run on a small CMake project shaped like the sdist (real cmake and
ninja, seconds instead of the real compile's minutes): `make demo` builds the core (libllama.so alone: kiln
quantizes and tokenizes through its C API); the rest (llama-server and the benches' programs) is added later from the kept
build tree, compiling only what it adds, by `make llama-cpp` or by kiln the first time a recipe needs it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from kiln.core import llama_cpp_build as b

CMAKE = """cmake_minimum_required(VERSION 3.16)
project(fake C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(llama SHARED llama.c)
add_library(llama-common SHARED common.c)
add_library(server-extra SHARED extra.c)
foreach(t llama-quantize llama-tokenize llama-perplexity llama-bench)
  add_executable(${t} main.c)
  target_link_libraries(${t} llama llama-common)
endforeach()
add_executable(llama-server main.c)
target_link_libraries(llama-server llama llama-common server-extra)
"""


def _sdist(tmp_path: Path) -> Path:
    root = "llama_cpp_python-0/vendor/llama.cpp/"
    files = {root + "CMakeLists.txt": CMAKE, root + "llama.c": "int llama(void) { return 1; }\n",
             root + "extra.c": "int extra(void) { return 2; }\n",
             root + "common.c": "int common(void) { return 3; }\n", root + "main.c": "int main(void) { return 0; }\n",
             root + b.PATCH_FILE: b.PATCH_FROM, root + "convert_hf_to_gguf.py": "", root + "conversion/__init__.py": "",
             root + "gguf-py/gguf/__init__.py": "", root + "models/ggml-vocab-big.gguf": "x" * 1000,
             "llama_cpp_python-0/llama_cpp/llama_cpp.py": ""}
    path = tmp_path / "fake.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_LLAMA_CPP_DIR", raising=False)
    archive = _sdist(tmp_path)
    monkeypatch.setattr(b, "_sdist", lambda downloads: archive)
    return archive


def test_the_core_first_then_the_rest_completes_the_install(fake_source: Path) -> None:
    final = b.build(jobs=1, targets=b.CORE_TARGETS)
    assert b.complete(final, b.CORE_TARGETS) and not b.complete(final)
    assert not (final / "bin" / "llama-server").exists() and b.binary("llama-server") is None
    tree = b.tree_dir()
    assert not list(tree.glob("*/vendor/llama.cpp/models"))  # the sdist's test vocabularies are not kept
    assert (final / "bin" / "libllama.so").is_file() and not (final / "bin" / "libllama-common.so").exists()
    library = (final / "bin" / "libllama.so").stat().st_ino

    assert b.build(jobs=1) == final
    assert b.complete(final) and (final / "bin" / "libserver-extra.so").is_file()
    assert (final / "bin" / "libllama.so").stat().st_ino == library  # the core's library stays as it was
    assert "added llama-server llama-perplexity llama-bench llama-quantize" in (final / "BUILD").read_text()
    assert not tree.exists()  # complete: the tree is gone


def test_the_core_compiles_no_common_library_and_the_rest_does_not_recompile_it(fake_source: Path) -> None:
    b.build(jobs=1, targets=b.CORE_TARGETS)
    assert not list((b.tree_dir() / "build").rglob("common.c.o"))  # llama-quantize's and llama-tokenize's `common`
    core_object = next((b.tree_dir() / "build").rglob("llama.c.o"))
    compiled_at = core_object.stat().st_mtime_ns
    log = b.tree_dir().parent / "rest.log"
    b.build(jobs=1, targets=(*b.CORE_TARGETS, "llama-server"), log=log)  # the tree stays: the benches are missing
    assert core_object.stat().st_mtime_ns == compiled_at
    assert "llama.c.o" not in log.read_text() and "extra.c.o" in log.read_text()


def test_kiln_compiles_a_missing_program_once_where_the_core_is_built(fake_source: Path, capsys) -> None:
    assert b.ensure("llama-server") is None  # nothing built: the caller says to run make llama-cpp
    b.build(jobs=1, targets=b.CORE_TARGETS)
    path = b.ensure("llama-server")
    assert path == b.install_dir() / "bin" / "llama-server" and path.is_file()
    assert "compiling the rest of llama.cpp once" in capsys.readouterr().err
    assert b.ensure("llama-server") == path and capsys.readouterr().err == ""  # once


def test_an_interrupted_unpack_is_made_again(fake_source: Path) -> None:
    tree = b.tree_dir()
    (tree / "half").mkdir(parents=True)  # what a kill during the unpack leaves: no .configured
    final = b.build(jobs=1, targets=b.CORE_TARGETS)
    assert not (tree / "half").exists() and b.complete(final, b.CORE_TARGETS)
