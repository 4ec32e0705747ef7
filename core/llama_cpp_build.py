"""Build llama.cpp once per machine into kiln's cache (`python -m kiln.core.llama_cpp_build`).

The build lives in `llama.cpp/` under `kiln_cache()` ($KILN_CACHE, else ~/.cache/kiln), where every
stage looks: `make llama-cpp` and a later `kiln run` from any folder agree on it.

No prebuilt llama.cpp can be downloaded here, so the install step compiles it from a registry
source: the llama-cpp-python sdist on PyPI vendors llama.cpp. One source for the binaries, the
`convert_hf_to_gguf.py` converter and the Python binding: the sdist's pure-Python ctypes package
`llama_cpp/` is copied beside the shared libraries it loads (`LLAMA_CPP_LIB_PATH`), which the
llama_cpp engine uses in-process to score prompts (engine/llama_cpp_binding.py, engine/llama_cpp_scoring.py). The build is keyed by
that version and by the CPU's flags (`GGML_NATIVE=ON` compiles for this CPU: a cache copied to
another CPU could crash with an illegal instruction), done in a temporary folder and renamed into
place, under a file lock so two `make` runs build it once. One compile with shared libraries: the
programs and `libllama.so`/`libggml*.so` sit together in `bin/` and find each other through an
`$ORIGIN` rpath, so the folder can be renamed after linking.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python on PyPI; its vendor/llama.cpp is the llama.cpp kiln runs
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TARGETS = ("llama-server", "llama-quantize", "llama-tokenize", "llama-perplexity", "llama-bench")
LIBRARY = "libllama.so"  # what the binding loads; the libggml*.so it links sit beside it
# No AMX, whatever the CPU flags say: GGML_NATIVE compiles ggml's AMX matmul wherever cpuid reports AMX,
# and on this project's 2-core VMs that do (amx_tile, amx_int8, the kernel granting XTILEDATA),
# llama-server and llama-bench died at their first prompt batch on q8_0 and q4_0 at 2 threads (SIGILL
# at tilezero in tinygemm_kernel_amx, a general protection fault on the other thread); f32 ran. Batch-1
# decode takes the AVX512-VNNI path either way. GCC's explicit -mno-* wins over -march=native's flags.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
               "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}")
BINDING = "python"  # the sdist's llama_cpp/ package is copied to <install>/python/llama_cpp
# One patch to the vendored llama-server, applied before building (part of the cache key). In stream
# mode the server sends a token only once the generated text ends in complete UTF-8, and a token
# held back that way is never sent: the stream loses its id (seen on the tiny random Llama: 16
# tokens generated, none streamed). kiln needs every id, so with `return_tokens` a held-back token
# is streamed at once with empty text (the text still arrives with the token that completes it).
PATCH_ID = "kiln3"  # the build's cache key: kiln2 added the shared libraries and the binding, kiln3 no AMX
PATCH_FILE = "tools/server/server-context.cpp"
PATCH_FROM = """        if (incomplete) {
            slot.has_next_token = true;
        }
"""
PATCH_TO = """        if (incomplete) {
            slot.has_next_token = true;
            if (slot.task->params.stream && slot.task->params.return_tokens) {  // kiln: stream every token id
                result.text_to_send = "";
                slot.add_token(result);
                send_partial_response(slot, result, false);
            }
        }
"""
# What the converter needs beside itself: the `conversion` package and the tree's own gguf-py,
# which it puts first on sys.path (it is ahead of PyPI's gguf 0.19.0 of the same version number:
# the converter needs its `LazyChunkedTensor`). kiln's own reader uses the pinned PyPI gguf.
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def kiln_cache() -> Path:
    """kiln's one cache: $KILN_CACHE if set, else ~/.cache/kiln, whatever the current folder.

    Every stage, `kiln prepare-demo`, this build and its lookup, `make` and the test suite use it
    (pipeline/demo.py's `cache_root` returns it). It is defined here because this module must run
    with Python's standard library alone: the Makefile runs it before kiln is installed.
    """
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser()


def cache_root() -> Path:
    """Where the llama.cpp builds live: `llama.cpp/` in kiln's cache."""
    return kiln_cache() / "llama.cpp"


def cpu_key() -> str:
    """The CPU's instruction-set flags, hashed: what GGML_NATIVE compiles for."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return hashlib.sha256(f"{os.uname().machine} {flags}".encode()).hexdigest()[:12]


def install_dir() -> Path:
    """Where this machine's build lives (it may not exist yet)."""
    return cache_root() / f"{VERSION}-{PATCH_ID}-{cpu_key()}"


def binary(name: str) -> Path | None:
    """Path of a built llama.cpp program, or None when the build is absent."""
    override = os.environ.get("KILN_LLAMA_CPP_DIR")
    base = Path(override) if override else install_dir()
    path = base / "bin" / name
    return path if path.is_file() else None


def converter() -> Path | None:
    base = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or install_dir())
    path = base / "convert_hf_to_gguf.py"
    return path if path.is_file() and (base / "gguf-py").is_dir() else None


def library_dir() -> Path | None:
    """The folder holding libllama.so and the binding's package folder `llama_cpp`, or None."""
    base = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or install_dir())
    ok = (base / "bin" / LIBRARY).is_file() and (base / BINDING / "llama_cpp" / "llama_cpp.py").is_file()
    return base if ok else None


def complete(path: Path) -> bool:
    return (all((path / "bin" / n).is_file() for n in (*TARGETS, LIBRARY))
            and all((path / n).exists() for n in (*CONVERTER, BINDING)))


def _sdist(downloads: Path) -> Path:
    path = downloads / SDIST
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(downloads)],
                       check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        path.unlink()
        raise SystemExit(f"{SDIST}: sha256 {digest} is not the pinned {SDIST_SHA256}; deleted, run again.")
    return path


def _patch(path: Path) -> None:
    text = path.read_text()
    if text.count(PATCH_FROM) != 1:
        raise SystemExit(f"{path}: the code kiln patches is not there once; update PATCH_FROM for llama.cpp {VERSION}")
    path.write_text(text.replace(PATCH_FROM, PATCH_TO))


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """Extract `members` under `dest` with tarfile's "data" filter, or, on a Python without it (before
    3.11.4: Debian 12's python3 is 3.11.2), refuse as it would what the build never needs: a member that
    is not a plain file or folder, or whose path leaves `dest`."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    root = dest.resolve()
    for m in members:
        if not (m.isfile() or m.isdir()) or not (root / m.name).resolve().is_relative_to(root):
            raise SystemExit(f"{SDIST}: {m.name!r} is not a plain file or folder inside the archive; not extracting it")
    tar.extractall(dest, members=members)


def build(jobs: int | None = None) -> Path:
    """Build (once) and return the install folder."""
    final = install_dir()
    if complete(final):
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(final):  # another process built it while we waited
            return final
        if final.exists():  # made by an older kiln that installed less: build it again
            shutil.rmtree(final)
        sdist = _sdist(root / "downloads")
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
            work = Path(tmp)
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers()
                           if "/vendor/llama.cpp/" in m.name or m.name.split("/")[1:2] == ["llama_cpp"]]
                _extract(tar, members, work)
            src = next(work.glob("*/vendor/llama.cpp"))
            _patch(src / PATCH_FILE)
            out = work / "install"
            (out / "bin").mkdir(parents=True)
            started = time.monotonic()
            jobs = jobs or os.cpu_count() or 2
            subprocess.run(["cmake", "-S", str(src), "-B", str(work / "build"), "-G", "Ninja", *CMAKE_FLAGS],
                           check=True, stdout=subprocess.DEVNULL)
            subprocess.run(["cmake", "--build", str(work / "build"), "-j", str(jobs), "--target", *TARGETS],
                           check=True)
            for name in TARGETS:
                shutil.copy2(work / "build" / "bin" / name, out / "bin" / name)
            for lib in (work / "build" / "bin").glob("lib*.so*"):  # with their soname links
                shutil.copy2(lib, out / "bin" / lib.name, follow_symlinks=False)
            shutil.copytree(next(work.glob("*/llama_cpp")), out / BINDING / "llama_cpp",
                            ignore=shutil.ignore_patterns("server", "__pycache__"))
            for name in CONVERTER:
                if (src / name).is_dir():
                    shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("tests", "examples"))
                else:
                    shutil.copy2(src / name, out / name)
            seconds = time.monotonic() - started
            (out / "BUILD").write_text(f"llama-cpp-python {VERSION} sdist, vendored llama.cpp\n"
                                       f"cmake {' '.join(CMAKE_FLAGS)}\ntargets {' '.join(TARGETS)} (+ {LIBRARY})\n"
                                       f"jobs {jobs}\nseconds {seconds:.0f}\n")
            os.rename(out, final)  # atomic: a half-built folder never carries the final name
    return final


def main() -> None:
    if sys.argv[1:] == ["--check"]:  # CI (ci/action.yml): is this machine's build there? Builds nothing.
        done = complete(install_dir())
        print(f"llama.cpp {VERSION}: {install_dir()} {'complete' if done else 'missing or incomplete'}")
        raise SystemExit(0 if done else 1)
    path = build()
    print(f"llama.cpp {VERSION}: {path}")


if __name__ == "__main__":
    main()
