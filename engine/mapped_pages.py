"""Drop-behind for a weights file an engine maps and reads once to build its own copy.

llama.cpp maps a GGUF and, at load, repacks some tensor types (Q4_K into q4_K_8x8 on x86) into a
buffer of its own; OpenVINO's CPU plugin maps the IR's `.bin` and, at the first inference, repacks the
compressed weights into its own layout. Neither reads those mapped pages again, but they stay in
the process's resident set: measured at 1B, llama.cpp q4_K_M held 1.68x its file, OpenVINO int8 2.4x
its weights, and the peak of the stage that loads them counted both copies.

`drop_behind(path)` wraps such a call: while it runs, a thread drops the process's resident pages of
every read-only mapping of `path` (madvise MADV_DONTNEED) over and over, and once more when it ends.
What the engine still reads in place (llama.cpp's tensors it does not repack) faults back in from the
page cache on its next read, a minor fault; nothing is lost, as a mapping without write permission
holds no page of its own. The pages stay in the kernel's page cache, which it reclaims under
pressure as it would have reclaimed them mapped. On a system without /proc/self/maps it does
nothing.

`drop_behind(..., private=True)` also drops a private writable mapping none of whose pages the process
has written (`unwritten`): torch maps a safetensors checkpoint so, and OpenVINO's build reads each weight
once as it traces and compresses it. The caller vouches that nothing writes the mapping meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

MADV_DONTNEED = 4
MIN_INTERVAL_S = 0.02


def release(*paths: Path | str, unwritten: Collection[tuple[int, int]] = ()) -> int:
    """Drop this process's resident pages of every read-only mapping of `paths`, and of the private
    writable ones `unwritten` lists (see `unwritten`); the bytes mapped."""
    done = 0
    for start, end, perms in _mappings({os.path.realpath(p) for p in paths}):
        if "w" in perms and (start, end) not in unwritten:
            continue
        if _libc().madvise(start, end - start, MADV_DONTNEED) == 0:
            done += end - start
    return done


def unwritten(*paths: Path | str) -> frozenset[tuple[int, int]]:
    """(start, end) of each private writable mapping of `paths` (torch maps safetensors files
    copy-on-write) of which the process has written no page (smaps' Anonymous 0): every page is still
    the file's, so dropping it loses nothing, for as long as nothing writes it."""
    targets = {os.path.realpath(p) for p in paths}
    return frozenset((start, end) for start, end, perms, path, fields in _smaps()
                     if path in targets and perms.endswith("p") and fields.get("Anonymous:") == 0)


def _mappings(targets: set[str]) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of each mapping of `targets`."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n") in targets:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1]))
    return found


def resident(path: Path | str) -> int:
    """Bytes of `path` resident in this process through its mappings (smaps' Rss), 0 if unmapped."""
    target = os.path.realpath(path)
    return sum(fields.get("Rss:", 0) * 1024 for _, _, _, mapped, fields in _smaps() if mapped == target)


def _smaps() -> Iterator[tuple[int, int, str, str, dict[str, int]]]:
    """Each mapping of this process as /proc/self/smaps gives it: start, end, permissions, the path
    mapped ('' for anonymous memory) and its kB fields ("Rss:", "Anonymous:", ...). Nothing when
    smaps cannot be read."""
    try:
        with open("/proc/self/smaps") as smaps:
            lines = smaps.readlines()
    except OSError:
        return
    current: tuple[int, int, str, str] | None = None
    fields: dict[str, int] = {}
    for line in lines:
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            if current:
                yield (*current, fields)
            start, end = (int(x, 16) for x in head[0].split("-"))
            current, fields = (start, end, head[1], head[5].rstrip("\n") if len(head) == 6 else ""), {}
        elif len(head) >= 2 and head[1].isdigit():
            fields[head[0]] = int(head[1])
    if current:
        yield (*current, fields)


@contextlib.contextmanager
def drop_behind(*paths: Path | str, private: bool = False) -> Iterator[None]:
    """Release `paths`' mapped pages while the block runs (every 20 ms, or five times as long as one
    release takes, whichever is longer) and once after it. `private`: also their private writable
    mappings that are `unwritten` as the block starts; the caller vouches nothing writes them in it."""
    stop = threading.Event()
    clean = unwritten(*paths) if private else frozenset()

    def loop() -> None:
        interval = MIN_INTERVAL_S
        while not stop.wait(interval):
            began = time.perf_counter()
            release(*paths, unwritten=clean)
            interval = max(MIN_INTERVAL_S, 5 * (time.perf_counter() - began))

    thread = threading.Thread(target=loop, name="kiln-drop-behind", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        release(*paths, unwritten=clean)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
