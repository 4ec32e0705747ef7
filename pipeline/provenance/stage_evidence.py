"""A stage's sealed evidence: what it read and what it wrote, signed, so a reused result is one kiln computed.

A stage's key is the hash of what it read (`stage_key`: its config, the content hashes of its inputs).
`seal` writes `evidence.dsse.json` into the stage folder: an in-toto Statement (kiln.core.signing) whose
subjects are every file of the folder (relative POSIX path, sha256) and whose predicate holds the stage,
its key and the inputs hashed into it. `check` recomputes all of it before anything reads the stage again
(a reuse from the cache or the tracking server, the gate): a changed, missing or added file, another
key, or a signature from no trusted key is NotVerified, naming which.

Rehashing a model-sized build stage on every reuse costs seconds, so a stat cache (under kiln's cache,
one file per stage key) remembers each file's digest with its size, mtime, ctime, inode and device when
it was hashed, and skips rehashing only while all of them still match. ctime cannot be set by user tools
(`touch`, `cp -p`, `rsync -a` restore mtime only) and changes on every write, chmod or link, so a file
rewritten in place is always hashed again. Correctness never depends on the cache: a stale or edited
entry can only name a digest for an inode whose stat it matches. Unlike a checkpoint's hash
(core.files.cached_tree_hash), a file changed within the clock's tick of its sealing is remembered
too: kiln wrote it a moment before into its own `.partial` folder, and whoever could change it in
that tick could as well have changed it before the seal; refusing to remember it would rehash a
model-sized stage when the gate reads it seconds later.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kiln.core import signing
from kiln.core.errors import NotVerified
from kiln.core.files import atomic_write_json, hash_of, read_json, sha256_file
from kiln.core.versions import library_versions

# Bump when a stage's output format or computation changes: old cache entries stop matching.
STAGE_FORMAT = 1
ENVELOPE = "evidence.dsse.json"
PREDICATE_TYPE = "https://kiln.dev/stage-evidence/v1"


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    """The digest of what a stage reads: the one place its key is derived."""
    return hash_of({"stage": stage, "format": STAGE_FORMAT, "inputs": inputs})


def seal(stage_dir: Path, stage: str, key: str, inputs: dict[str, Any], *,
         origin: dict[str, Any] | None = None) -> None:
    """Sign the digests of every file in `stage_dir` with the stage, its key and its inputs.
    `origin`: for a copy verified elsewhere and sealed again here (a Ray node's stage on the driver),
    who signed it first and where it came from."""
    stage_dir = Path(stage_dir)
    subjects = [signing.Subject(name, digest) for name, digest in sorted(digests(stage_dir, stage, key).items())]
    predicate = {"stage": stage, "key": key, "inputs": inputs,
                 "kiln_version": library_versions(("kiln",)).get("kiln"),
                 "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **({"origin": origin} if origin else {})}
    atomic_write_json(stage_dir / ENVELOPE, signing.sign(signing.statement(subjects, PREDICATE_TYPE, predicate)))


def check(stage_dir: Path, stage: str, key: str, trusted: dict[str, Any] | None = None, *,
          what: str | None = None, present_only: bool = False) -> signing.Verified:
    """The stage's verified statement, once its signature is from a `trusted` key (default: this
    machine's, `signing.trusted_keys()`), it is for `stage` and `key`, and every file matches its
    digest; else NotVerified naming `what` (default: the folder) and the first thing that does not.
    `present_only`: files the statement names may be absent (a copy holding a build stage's records
    but not its model), never changed or added."""
    stage_dir = Path(stage_dir)
    what = what or str(stage_dir)
    envelope = stage_dir / ENVELOPE
    if not envelope.is_file():
        raise NotVerified(f"{what}: no sealed evidence ({ENVELOPE}): it was written by a kiln that did not seal "
                          "its stages, or by something that is not kiln")
    try:
        sealed = read_json(envelope)
    except (OSError, ValueError) as e:
        raise NotVerified(f"{what}: {ENVELOPE} is not readable JSON ({e})") from None
    verified = signing.verify(sealed, PREDICATE_TYPE, what, trusted)
    _check_claim(verified.predicate, stage, key, what)
    _check_files(verified.subjects(), digests(stage_dir, stage, key), what, present_only)
    return verified


def _check_claim(predicate: dict[str, Any], stage: str, key: str, what: str) -> None:
    """The statement is about this stage and key, and its inputs are the ones the key was derived from."""
    if predicate.get("stage") != stage or predicate.get("key") != key:
        raise NotVerified(f"{what}: its evidence is for stage {predicate.get('stage')} key "
                          f"{str(predicate.get('key'))[:12]}, not {stage} key {key[:12]}")
    if stage_key(stage, predicate.get("inputs")) != key:
        raise NotVerified(f"{what}: the inputs its evidence records do not hash to its key {key[:12]}")


def _check_files(want: dict[str, str], have: dict[str, str], what: str, present_only: bool) -> None:
    for name in sorted(set(want) | set(have)):
        if name not in want:
            raise NotVerified(f"{what}: {name} was not written by the stage (a file added after it was sealed)")
        if name not in have:
            if present_only:
                continue
            raise NotVerified(f"{what}: {name} is missing (the stage sealed it)")
        if have[name] != want[name]:
            raise NotVerified(f"{what}: {name} has changed since the stage sealed it "
                              f"(sha256 {have[name][:12]}, sealed {want[name][:12]})")


def check_record(record: dict[str, Any], trusted: dict[str, Any] | None = None) -> signing.Verified:
    """`check` for a run folder's stage record (`<run>/stages/<stage>-<role>.json`): its stage folder,
    stage and key."""
    return check(Path(record["path"]), record["stage"], record["key"], trusted,
                 what=f"stage {record['stage']}[{record['role']}] ({record['path']})")


# --- digests, with the stat cache ---


def _files(root: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of every file under `root` but the envelope. A link is hashed
    as what it points at; a link to a folder is not followed (kiln's stages write none)."""
    out = []
    for folder, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            p = Path(folder) / name
            rel = p.relative_to(root).as_posix()
            if rel != ENVELOPE:
                out.append((rel, p))
    return sorted(out)


def stat_cache(stage: str, key: str) -> Path:
    from kiln.core.home import kiln_cache

    return kiln_cache() / "stat-cache" / stage / f"{key}.json"


def _stat(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _digest(p: Path) -> str:
    if p.is_dir():  # a link to a folder: what it names
        return signing.sha256_bytes(b"link:" + os.readlink(p).encode())
    return sha256_file(p)


def digests(root: Path, stage: str, key: str) -> dict[str, str]:
    """sha256 of every file under `root` (relative POSIX path -> digest), rehashing only files whose
    stat differs from the one recorded when they were last hashed (module docstring)."""
    cache = stat_cache(stage, key)
    try:
        known = read_json(cache)
    except (OSError, ValueError):
        known = {}
    out, seen = {}, {}
    for rel, p in _files(Path(root)):
        try:
            stat = _stat(p)  # before hashing: a write during the hash changes it, and the entry never matches
            entry = known.get(rel)
            out[rel] = entry[-1] if isinstance(entry, list) and entry[:-1] == stat else _digest(p)
        except OSError:  # a dangling link, or removed while read: hashed as missing
            continue
        seen[rel] = [*stat, out[rel]]
    if seen != known:
        try:
            atomic_write_json(cache, seen)
        except OSError:  # a read-only cache: only speed is lost
            pass
    return out
