"""What kiln's cache holds, what of it is needed, and pruning the rest without leaving half a stage.

Two kinds of entries can be pruned, the cache's computed outputs:
- a stage, stages/<kind>/<key>/ (result, manifest and files; an optimize stage's model/);
- an engine, engines/<key>/ (built by an engine or tune stage; kiln-engine.json names its source).
Everything else (the demo model and data, llama.cpp's build, checkpoint hashes, tokenized ids,
MLflow's empty-store template) is listed by folder and never pruned: each is an input or a tool,
and rebuilding one costs minutes (llama.cpp: most of an hour).

An entry is *needed*, and never pruned, when
1. a kiln process is computing or checking it now (it holds locks/<kind>/<key>.lock), or a
   running kiln run has used it (it holds locks/<kind>/<key>.use shared until it ends);
2. the run folder of a registered model version lists it (its `kiln.run_dir` tag; the folder's
   stages/*.json and candidates/*/stages/*.json name every stage the verdict was judged on);
3. a needed entry depends on it: an engine stage on its engine, an engine on the optimize
   stage whose model it loads;
4. it is an engine no stage refers to while some stage is computing (the engine being built).
Pruning an entry prunes what depends on it with it, so a kept engine stage never names a missing
engine. An entry was *last used* when it was finished or a run last used it (the .use file's
time), or when anything that depends on it was: an entry is as old as its youngest dependant.

An entry is filed under the model of every run folder whose records name it (what it needs, under
the same). Stages are keyed by content, so one stage serves every copy of a checkpoint, and its
manifest names only the model folder of the run that computed it first: filed by manifests alone,
every demo stage built on an artifact that a run of the user's copy of the demo model had computed
went under the user's model. An entry no run folder here names is filed by its manifest.

Deleting is a rename into trash/ (atomic: a reader sees the whole entry or none) under the
entry's locks, then removal; a prune killed half-way leaves only trash, which the next one empties.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.pipeline.stages.base import MANIFEST, RESULT, stage_lock, stage_use

ENGINE = "engine folder"  # an engines/<key> entry's kind (a stage kind names the rest)
ENGINE_MANIFEST = "kiln-engine.json"  # kiln.engine.base.MANIFEST, read here without importing the engines
PARTIAL = ".partial"


@dataclass
class Entry:
    kind: str  # the stage's kind ("optimize", "engine", "quality", ...) or ENGINE
    key: str
    path: Path
    finished: bool  # False: a .partial folder (a stage killed half-way, or being written now)
    model: str = "?"
    bytes: int = 0  # disk usage, each hard-linked file once
    last_used: float = 0.0
    requires: set[Path] = field(default_factory=set)  # entries this one needs to stay usable
    needed: str = ""  # why it must stay; "" when it may go

    @property
    def locks(self) -> list[Path]:
        if self.kind == ENGINE:
            return []
        cache = self.path.parents[2]
        return [stage_lock(cache, self.kind, self.key), stage_use(cache, self.kind, self.key)]


@dataclass
class CacheIndex:
    root: Path
    entries: dict[Path, Entry]
    other: dict[str, int]  # top-level folder -> bytes (never pruned)
    inodes: dict[tuple[int, int], tuple[int, int, int]]  # (dev, ino) -> (bytes, links seen here, all its links)
    files: dict[Path, list[tuple[int, int]]]  # entry path -> its files' inodes

    @property
    def total(self) -> int:
        return sum(b for b, _, _ in self.inodes.values())

    def freed(self, paths: set[Path]) -> int:
        """Bytes deleting `paths` frees: files with no hard link left outside them (a baseline's
        weights linked to the user's checkpoint free nothing)."""
        inside: dict[tuple[int, int], int] = {}
        for p in paths:
            for ino in self.files.get(p, []):
                inside[ino] = inside.get(ino, 0) + 1
        return sum(self.inodes[ino][0] for ino, n in inside.items() if n == self.inodes[ino][2])

    def dependants(self, path: Path) -> set[Path]:
        """`path` and every entry that needs it, transitively."""
        out, todo = {path}, [path]
        while todo:
            p = todo.pop()
            for q in (q for q, e in self.entries.items() if p in e.requires and q not in out):
                out.add(q)
                todo.append(q)
        return out


def index(root: Path, registered_runs: Iterable[Path] | Mapping[Path, str] = (),
          run_models: Mapping[Path, str] | None = None) -> CacheIndex:
    """Walk the cache at `root`. `registered_runs`: the run folders whose stages are needed (the runs
    of registered versions), or a mapping of each to why; `run_models`: run folders and the model each
    ran on, which files the entries they name under it."""
    root = Path(root).resolve()  # runs record stage paths, and engines their source, resolved
    entries = {e.path: e for e in _entries(root)}
    _file_by_runs(entries, run_models or {})
    other: dict[str, int] = {}
    inodes: dict[tuple[int, int], tuple[int, int, int]] = {}
    files: dict[Path, list[tuple[int, int]]] = {p: [] for p in entries}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        owner = _owner(root, here)
        for name in filenames:
            try:
                st = os.lstat(here / name)
            except FileNotFoundError:  # a run replaced it meanwhile
                continue
            ino = (st.st_dev, st.st_ino)
            size, seen, links = inodes.get(ino, (st.st_blocks * 512, 0, st.st_nlink))
            inodes[ino] = (size, seen + 1, links)
            if owner in files:
                files[owner].append(ino)
            elif seen == 0:
                top = here.relative_to(root).parts[0] if here != root else name
                other[top] = other.get(top, 0) + size
    for path, entry in entries.items():
        entry.bytes = sum(inodes[i][0] for i in set(files[path]))
    _needed(root, entries, registered_runs)
    _ages(entries)
    return CacheIndex(root, entries, other, inodes, files)


def _owner(root: Path, folder: Path) -> Path | None:
    parts = folder.relative_to(root).parts
    if len(parts) >= 3 and parts[0] == "stages":
        return root / "stages" / parts[1] / parts[2]
    if len(parts) >= 2 and parts[0] == "engines":
        return root / "engines" / parts[1]
    return None


def _entries(root: Path) -> Iterator[Entry]:
    engines, artifacts = {}, {}
    stages = [Entry(d.parent.name, d.name.removesuffix(PARTIAL), d, not d.name.endswith(PARTIAL))
              for d in sorted(root.glob("stages/*/*")) if d.is_dir()]
    for d in sorted(root.glob("engines/*")):
        if d.is_dir():
            engines[d.name] = Entry(ENGINE, d.name.removesuffix(PARTIAL), d, not d.name.endswith(PARTIAL))
    for e in stages:  # optimize stages first: an artifact names the model the rest trace back to
        if e.kind == "optimize" and e.finished:
            manifest = _json(e.path / RESULT).get("manifest", {})
            e.model = Path(str(manifest.get("source") or "?")).name
            for sha in (manifest.get("sha256"), manifest.get("source_sha256")):
                if sha:
                    artifacts.setdefault(sha, e)
    for eng in engines.values():
        source = _json(eng.path / ENGINE_MANIFEST).get("source", {})
        src = Path(str(source.get("path") or "?"))
        art = artifacts.get(source.get("sha256"))
        eng.model = art.model if art else src.name
        if src.parent.parent == root / "stages" / "optimize":  # <cache>/stages/optimize/<key>/model
            eng.requires.add(src.parent)
    names = {**{sha: a.model for sha, a in artifacts.items()}, **{k: e.model for k, e in engines.items()}}
    for e in stages:
        if e.kind == "optimize" or not e.finished:
            continue
        engine_dir = _json(e.path / RESULT).get("engine_dir")
        if e.kind == "engine" and engine_dir and Path(engine_dir).name in engines:
            e.requires.add(engines[Path(engine_dir).name].path)
        e.model = next((names[v] for v in _strings(_json(e.path / MANIFEST).get("inputs")) if v in names), "?")
    yield from stages
    yield from engines.values()


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _recorded(run: Path) -> Iterator[Path]:
    """The cache folders a run folder's stage records name (every stage its verdict was judged on)."""
    for record in [*Path(run).glob("stages/*.json"), *Path(run).glob("candidates/*/stages/*.json")]:
        if path := _json(record).get("path"):
            yield Path(str(path)).resolve()


def _file_by_runs(entries: dict[Path, Entry], run_models: Mapping[Path, str]) -> None:
    """Each entry a run names under that run's model, and what it needs under the same."""
    models: dict[Path, set[str]] = {}
    for run, model in run_models.items():
        for path in _recorded(run):
            if path in entries:
                models.setdefault(path, set()).add(model)
    todo = list(models)
    while todo:
        e = entries[todo.pop()]
        for p in e.requires:
            if p in entries and not models[e.path] <= models.get(p, set()):
                models.setdefault(p, set()).update(models[e.path])
                todo.append(p)
    for path, names in models.items():
        entries[path].model = ", ".join(sorted(names))


def _needed(root: Path, entries: dict[Path, Entry], registered_runs: Iterable[Path] | Mapping[Path, str]) -> None:
    why = registered_runs if isinstance(registered_runs, Mapping) else \
        {Path(r): f"registered version's run {Path(r).name}" for r in registered_runs}
    for run, reason in why.items():
        for path in _recorded(run):
            if path in entries and not entries[path].needed:
                entries[path].needed = reason
    for e in entries.values():
        if e.locks and not e.needed:
            e.needed = _held(e)
    computing = any(_taken(p) for p in root.glob("locks/*/*.lock") if p.parent.name != "registry")
    referred = {p for e in entries.values() for p in e.requires}
    for e in entries.values():
        if e.kind == ENGINE and e.path not in referred and computing and not e.needed:
            e.needed = "a stage is computing (this engine may be the one it builds)"
    todo = [e for e in entries.values() if e.needed]
    while todo:
        e = todo.pop()
        for p in e.requires:
            if p in entries and not entries[p].needed:
                entries[p].needed = f"needed by {e.kind} {e.key[:12]}"
                todo.append(entries[p])


def _held(e: Entry) -> str:
    lock, use = e.locks
    if _taken(lock):
        return "a kiln process is computing or checking it"
    if _taken(use):
        return "a running kiln run uses it"
    return ""


def _taken(path: Path) -> bool:
    """Whether another process holds a flock on `path` now."""
    if not path.exists():
        return False
    with _try_lock(path) as got:
        return not got


@contextlib.contextmanager
def _try_lock(path: Path) -> Iterator[bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _ages(entries: dict[Path, Entry]) -> None:
    for e in entries.values():
        times = []
        for p in (e.path, *e.locks[1:]):
            with contextlib.suppress(FileNotFoundError):
                times.append(p.stat().st_mtime)
        e.last_used = max(times, default=0.0)
    # An entry is as old as its youngest dependant: an optimize stage used only through its engine stays.
    changed = True
    while changed:
        changed = False
        for e in entries.values():
            for p in e.requires:
                if p in entries and entries[p].last_used < e.last_used:
                    entries[p].last_used, changed = e.last_used, True


def plan_prune(ix: CacheIndex, older_than_s: float | None, max_bytes: int | None,
               now: float | None = None) -> list[Entry]:
    """What to delete: every unneeded entry last used more than `older_than_s` ago, then the
    least recently used until the cache is at most `max_bytes` (each with what depends on it)."""
    now = time.time() if now is None else now
    free = [e for e in ix.entries.values() if not e.needed]
    free.sort(key=lambda e: (e.last_used, e.kind == "optimize"))  # an artifact after what it feeds
    chosen: set[Path] = set()
    for e in free:
        if older_than_s is not None and now - e.last_used > older_than_s:
            chosen |= ix.dependants(e.path)
    for e in free:
        if max_bytes is None or ix.total - ix.freed(chosen) <= max_bytes:
            break
        chosen |= ix.dependants(e.path)
    return sorted((ix.entries[p] for p in chosen), key=lambda e: (e.kind == "optimize", e.kind == ENGINE, e.last_used))


def prune(ix: CacheIndex, doomed: list[Entry]) -> tuple[list[Entry], list[Entry]]:
    """Delete `doomed` (from `plan_prune`): each stage under its two locks, taken without waiting;
    one a process took meanwhile is kept, with everything it needs. Returns (deleted, kept)."""
    trash = ix.root / "trash"
    empty_trash(ix.root)
    with contextlib.ExitStack() as stack:
        busy = [e for e in doomed if not all(stack.enter_context(_try_lock(p)) for p in e.locks)]
        keep = {p for e in busy for p in _requires_closure(ix, e.path)}
        deleted = [e for e in doomed if e.path not in keep]
        trash.mkdir(parents=True, exist_ok=True)
        for e in deleted:
            with contextlib.suppress(FileNotFoundError):  # another prune took it first
                os.rename(e.path, trash / f"{e.kind}-{e.path.name}-{os.getpid()}")
    empty_trash(ix.root)
    return deleted, [e for e in doomed if e.path in keep]


def _requires_closure(ix: CacheIndex, path: Path) -> set[Path]:
    """`path` and everything it needs, transitively."""
    out, todo = {path}, [path]
    while todo:
        entry = ix.entries.get(todo.pop())
        for p in entry.requires if entry else ():
            if p not in out:
                out.add(p)
                todo.append(p)
    return out


def empty_trash(root: Path) -> None:
    for d in sorted((Path(root) / "trash").glob("*")):
        shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
