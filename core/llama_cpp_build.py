"""Build llama.cpp once per machine into kiln's cache (`python -m kiln.core.llama_cpp_build`).

The build lives in `llama.cpp/` under `kiln_cache()` (core/home.py: $KILN_CACHE, else ~/.cache/kiln), where every
stage looks: `make llama-cpp` and a later `kiln run` from any folder agree on it.

No prebuilt llama.cpp can be downloaded here, so the install step compiles it from a registry
source: the llama-cpp-python sdist on PyPI vendors llama.cpp. One source for the binaries, the
`convert_hf_to_gguf.py` converter and the Python binding: the sdist's pure-Python ctypes package
`llama_cpp/` is copied beside the shared libraries it loads (`LLAMA_CPP_LIB_PATH`), which the
llama_cpp engine uses in-process to score prompts (engine/llama_cpp/binding.py, engine/llama_cpp/scoring.py). The build is keyed by
that version and by the CPU's flags (`GGML_NATIVE=ON` compiles for this CPU: a cache copied to
another CPU could crash with an illegal instruction), assembled in a build tree and renamed into
place, under a file lock so two `make` runs build it once. In two parts where the demo asks: `--core`
(what the demo runs on) first, and the rest later from the tree that build keeps (`ensure`: kiln
compiles llama-server itself the first time a recipe needs it). One compile with shared libraries: the
programs and `libllama.so`/`libggml*.so` sit together in `bin/` and find each other through an
`$ORIGIN` rpath, so the folder can be renamed after linking.
"""

from __future__ import annotations

import contextlib
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

if __package__:
    from kiln.core.home import kiln_cache
else:  # `python3 core/llama_cpp_build.py` (the Makefile) before kiln is installed: core/ is sys.path[0], and
    from home import kiln_cache  # type: ignore[no-redef]  # home.py needs the standard library alone

VERSION = "0.3.36"  # llama-cpp-python on PyPI; its vendor/llama.cpp is the llama.cpp kiln runs
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# What the demo needs (`make demo`) is libllama.so alone (the `llama` target, with ggml): the library runtime and
# scoring load it, and the gguf method quantizes and tokenizes through its C API (optimize/gguf_native.py), so the
# demo's part compiles neither llama.cpp's `common` library nor a program. The rest (the server runtime's
# llama-server, the benches' llama-perplexity and llama-bench, and llama-quantize, kept to check the C API's file
# against the program's) is most of the compile on 2 cores: llama-server alone brings `common`, the multimodal
# library, the HTTP server and its JSON. It is built by `make llama-cpp`, `make test`, or kiln itself the first time
# a recipe asks for the server runtime, in the build tree the core's build left (only what is missing compiles).
CORE_TARGETS: tuple[str, ...] = ()
TARGETS = ("llama-server", "llama-perplexity", "llama-bench", "llama-quantize")
LIBRARY_TARGET = "llama"
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


def ensure(name: str) -> Path | None:
    """A built llama.cpp program, compiled now where the install lacks it but has the core (what `make
    demo` builds): the first recipe on the server runtime compiles the rest once, from the kept tree.
    None where nothing is built, or where KILN_LLAMA_CPP_DIR names a folder kiln does not build into."""
    path = binary(name)
    if path is not None or os.environ.get("KILN_LLAMA_CPP_DIR") or not complete(install_dir(), CORE_TARGETS):
        return path
    log = cache_root() / f"build-{install_dir().name}.log"
    print(f"llama.cpp: {name} is not built on this machine yet (`make demo` builds only what the demo runs on): "
          f"compiling the rest of llama.cpp once, about 5 minutes on 2 cores; its output: {log}",
          file=sys.stderr, flush=True)
    try:
        build(log=log)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"compiling llama.cpp's {name} failed ({e}): see {log}") from e
    return binary(name)


def converter() -> Path | None:
    base = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or install_dir())
    path = base / "convert_hf_to_gguf.py"
    return path if path.is_file() and (base / "gguf-py").is_dir() else None


def library_dir() -> Path | None:
    """The folder holding libllama.so and the binding's package folder `llama_cpp`, or None."""
    base = Path(os.environ.get("KILN_LLAMA_CPP_DIR") or install_dir())
    ok = (base / "bin" / LIBRARY).is_file() and (base / BINDING / "llama_cpp" / "llama_cpp.py").is_file()
    return base if ok else None


def complete(path: Path, targets: tuple[str, ...] = TARGETS) -> bool:
    """Whether `path` holds `targets` (every program by default), the library, the converter and the binding."""
    return (all((path / "bin" / n).is_file() for n in (*targets, LIBRARY))
            and all((path / n).exists() for n in (*CONVERTER, BINDING)))


def tree_dir() -> Path:
    """The build tree (source and objects) kept beside an install that lacks some programs, so that
    building them later compiles only what they add; removed once the install is complete."""
    return cache_root() / f".tree-{install_dir().name}"


def _sdist(downloads: Path) -> Path:
    path = downloads / SDIST
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        # pip reads an sdist's metadata before it keeps it, installing the build backend to do so. The
        # sdist alone is built from source: with `--no-binary :all:` the backend and its own build chain
        # were too, which took 310 s against 6 s on the 2-core EPYC VM, while the compile waited for it.
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
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


def build(jobs: int | None = None, targets: tuple[str, ...] = TARGETS, log: Path | None = None) -> Path:
    """Build (once) `targets` with the library, the binding and the converter; return the install folder.

    An install that has some programs gets the missing ones from the kept build tree (`tree_dir`).
    `log`: the compiler's output goes there instead of this process's output."""
    final = install_dir()
    if complete(final, targets):
        return final
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(final, targets):  # another process built it while we waited
            return final
        if final.exists() and not complete(final, CORE_TARGETS):  # made by an older kiln that installed less
            shutil.rmtree(final)
        started = time.monotonic()
        jobs = jobs or os.cpu_count() or 2
        src, out = _tree(root)
        build_dir = tree_dir() / "build"
        with open(log, "ab") if log else contextlib.nullcontext() as sink:
            subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", LIBRARY_TARGET, *targets],
                           check=True, stdout=sink, stderr=sink)
        seconds = time.monotonic() - started
        if final.exists():
            _add_programs(build_dir, final, targets, seconds, jobs)
        else:
            _assemble(src, build_dir, out, targets)
            _manifest(out, targets, seconds, jobs)
            os.rename(out, final)  # atomic: a half-built folder never carries the final name
        if complete(final):  # nothing left to add: the tree's 100+ MB go
            shutil.rmtree(tree_dir(), ignore_errors=True)
    return final


def _tree(root: Path) -> tuple[Path, Path]:
    """The kept build tree, unpacked, patched and configured (once: `.configured` marks it done; a tree
    an interrupted unpack left is made again), and the install folder to assemble in it."""
    tree = tree_dir()
    if not (tree / ".configured").is_file():
        shutil.rmtree(tree, ignore_errors=True)
        sdist = _sdist(root / "downloads")
        tree.mkdir(parents=True)
        with tarfile.open(sdist) as tar:
            _extract(tar, [m for m in tar.getmembers() if _needed(m.name)], tree)
        src = next(tree.glob("*/vendor/llama.cpp"))
        _patch(src / PATCH_FILE)
        subprocess.run(["cmake", "-S", str(src), "-B", str(tree / "build"), "-G", "Ninja", *CMAKE_FLAGS],
                       check=True, stdout=subprocess.DEVNULL)
        (tree / ".configured").write_text("")
    out = tree / "install"
    shutil.rmtree(out, ignore_errors=True)
    return next(tree.glob("*/vendor/llama.cpp")), out


def _needed(member: str) -> bool:
    """An sdist member the build reads: vendor/llama.cpp (less its top-level models/ and docs/, 113 MB of
    test vocabularies and pages the tree would keep for nothing) and the binding's llama_cpp/."""
    parts = member.split("/")
    if parts[1:2] == ["llama_cpp"]:
        return True
    return parts[1:3] == ["vendor", "llama.cpp"] and parts[3:4] not in (["models"], ["docs"])


def _assemble(src: Path, build_dir: Path, out: Path, targets: tuple[str, ...]) -> None:
    (out / "bin").mkdir(parents=True)
    for name in targets:
        shutil.copy2(build_dir / "bin" / name, out / "bin" / name)
    for lib in (build_dir / "bin").glob("lib*.so*"):  # with their soname links
        shutil.copy2(lib, out / "bin" / lib.name, follow_symlinks=False)
    shutil.copytree(next(tree_dir().glob("*/llama_cpp")), out / BINDING / "llama_cpp",
                    ignore=shutil.ignore_patterns("server", "__pycache__"))
    for name in CONVERTER:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("tests", "examples"))
        else:
            shutil.copy2(src / name, out / name)


def _add_programs(build_dir: Path, final: Path, targets: tuple[str, ...], seconds: float, jobs: int) -> None:
    """Copy into an existing install the programs and libraries it lacks, each under a temporary name
    and renamed into place: a reader sees a whole file or none. The libraries come first, the programs
    that load them after."""
    built = [lib for lib in (build_dir / "bin").glob("lib*.so*") if not (final / "bin" / lib.name).exists()]
    built += [build_dir / "bin" / n for n in targets if not (final / "bin" / n).exists()]
    for path in built:
        tmp = final / "bin" / f".{path.name}.tmp"
        shutil.copy2(path, tmp, follow_symlinks=False)
        os.replace(tmp, final / "bin" / path.name)
    with open(final / "BUILD", "a") as f:
        f.write(f"added {' '.join(targets)}: seconds {seconds:.0f}, jobs {jobs}\n")


def _manifest(out: Path, targets: tuple[str, ...], seconds: float, jobs: int) -> None:
    (out / "BUILD").write_text(f"llama-cpp-python {VERSION} sdist, vendored llama.cpp\n"
                               f"cmake {' '.join(CMAKE_FLAGS)}\ntargets {' '.join(targets)} (+ {LIBRARY})\n"
                               f"jobs {jobs}\nseconds {seconds:.0f}\n")


def main() -> None:
    if sys.argv[1:] == ["--core"]:  # `make demo`: only what the demo runs on (CORE_TARGETS)
        print(f"llama.cpp {VERSION} (the demo's part): {build(targets=CORE_TARGETS)}")
        return
    if sys.argv[1:] == ["--check"]:  # CI (ci/action.yml): is this machine's build there? Builds nothing.
        done = complete(install_dir())
        print(f"llama.cpp {VERSION}: {install_dir()} {'complete' if done else 'missing or incomplete'}")
        raise SystemExit(0 if done else 1)
    path = build()
    print(f"llama.cpp {VERSION}: {path}")


if __name__ == "__main__":
    main()
