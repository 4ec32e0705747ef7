"""Atomic writes and content hashes: the two things that make an interrupted run resumable.

Every artifact kiln writes lands through a temporary sibling and an `os.replace`, so a reader
(or a resumed run) sees either the old file or the whole new one, never half. Directories are
built under a `.partial` name and renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[Any]:
    """A file object whose bytes become `path` (through a temporary sibling) if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with _replacing(path) as f:
        f.write(data)


def atomic_copy_with(path: Path, head: bytes, skip: int) -> None:
    """Replace `path` atomically by `head` followed by its own bytes after the first `skip`."""
    with open(path, "rb") as src, _replacing(path) as out:
        out.write(head)
        src.seek(skip)
        shutil.copyfileobj(src, out, _CHUNK)


def atomic_write_text(path: Path, text: str) -> None:
    """Every text file kiln writes comes through here, so no credential ever lands in one."""
    from kiln.core.credentials import scrub

    atomic_write_bytes(path, scrub(text).encode())


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a scratch directory that becomes `final` only if the block completes.

    A leftover scratch directory from a killed run is removed first: it was never complete.
    """
    final = Path(final)
    scratch = final.with_name(final.name + ".partial")
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(scratch, final)


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive advisory lock (flock) on `path`, held for the block: two kiln processes on one
    cache take turns. The kernel drops it when the holder dies, so a killed run never leaves a
    stale lock. `on_wait` is called once if another process holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait:
                on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_tree(root: Path) -> str:
    """Hash a directory by relative paths and file contents (names and bytes, not mtimes)."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def hash_of(obj: Any) -> str:
    """Stable hash of a JSON-able object (dict key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def dir_size(root: Path) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


# What a file's signature holds. Its bytes cannot change without its ctime moving: no user tool sets
# ctime, and rewriting bytes (in place, by `cp` over it, by a rename onto it) moves it even when
# `cp -p`, `rsync -a`, `touch -d` or a reproducible tarball restore the mtime; a rename also brings a
# new inode. An entry written by an older kiln (path, size, mtime) never matches: it is rehashed once.
_SIGNED = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
# ctime is stamped from a coarse clock (a few ms on Linux, more on some filesystems): a file changed
# this little before it was hashed could change again within the same tick, unseen, so its signature
# is not remembered and it is hashed again next time (git's "racily clean" entries, the same rule).
RACY_NS = 2_000_000_000


def _signature(files: list[Path]) -> tuple[str, int]:
    """The stat signature of `files` and the latest ctime among them."""
    stats = [(str(p), p.stat()) for p in files]
    signature = hash_of([(name, *(getattr(st, field) for field in _SIGNED)) for name, st in stats])
    return signature, max((st.st_ctime_ns for _, st in stats), default=0)


def cached_tree_hash(root: Path, cache_file: Path) -> str:
    """`sha256_tree`, remembered by the tree's stat signature (`_SIGNED`: size, mtime, ctime, inode).

    Hashing a 500 MB checkpoint on every run costs seconds; the signature changes whenever a file's
    bytes do, even with its mtime restored, so a stale hash is never returned for changed content.
    """
    root = Path(root).resolve()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    now = time.time_ns()  # before the stat: a change after it moves a ctime past the one signed
    signature, changed = _signature(files)
    known = read_json(cache_file) if Path(cache_file).exists() else {}
    if known.get(str(root), {}).get("signature") == signature:
        return known[str(root)]["sha256"]
    digest = sha256_file(root) if root.is_file() else sha256_tree(root)
    if changed < now - RACY_NS:
        known[str(root)] = {"signature": signature, "sha256": digest}
    else:
        known.pop(str(root), None)
    atomic_write_json(cache_file, known)
    return digest
