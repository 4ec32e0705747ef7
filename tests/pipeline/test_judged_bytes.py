"""Issue 52, point 6: the judged bytes cannot change silently.

Two attacks on a checkpoint a run has judged. Weights rewritten in place with their mtime restored
(`cp -p`, `rsync -a`, a reproducible tarball) kept the (path, size, mtime) the hash was remembered
by, so every stage was reused and the registry saw "the same artifact as before"; now the stat
signature holds ctime and inode too, which no user tool can restore, and the bytes are hashed again.
And the `none` baseline hardlinked the user's weights into the cache, so new bytes written into the
user's file changed the artifact of a finished run under its manifest's sha256; now it is a copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.core import files
from kiln.core.files import cached_tree_hash, hash_of, sha256_tree
from tests.pipeline.conftest import fresh_cache, kiln, quick_recipe

WEIGHTS = "model.safetensors"


def _negated(path: Path, floats: int) -> bytes:
    """`path`'s bytes with the sign of its last `floats` fp32 values flipped: new weights, still a
    valid checkpoint of the same size (each rewrite below flips a different count, so two in a row
    never undo each other)."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) - 4 * floats, len(data), 4):
        data[i + 3] ^= 0x80
    return bytes(data)


def _after_a_tick(path: Path, probe: Path) -> None:
    """Return once the filesystem stamps a ctime later than `path`'s (a few ms): a change made after
    this moves `path`'s ctime. A change within the same tick is the race `RACY_NS` covers (below)."""
    while True:
        probe.touch()
        os.utime(probe)
        if probe.stat().st_ctime_ns > path.stat().st_ctime_ns:
            return


def _in_place(weights: Path, tmp: Path) -> None:
    """New bytes written into the file (its inode kept), then its mtime set back as `touch -d` does."""
    times = (weights.stat().st_atime_ns, weights.stat().st_mtime_ns)
    with open(weights, "r+b") as f:
        f.write(_negated(weights, 16))
    os.utime(weights, ns=times)


def _cp_p(weights: Path, tmp: Path) -> None:
    """`cp -p` of new weights of the same size and mtime over the file (cp keeps its inode)."""
    new = tmp / "new.safetensors"
    new.write_bytes(_negated(weights, 32))
    os.utime(new, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))
    subprocess.run(["cp", "-p", str(new), str(weights)], check=True)


def _rsync_a(weights: Path, tmp: Path) -> None:
    """What `rsync -a` and a tarball do: a new file beside it, its mtime set, renamed over it."""
    new = weights.with_name(".model.safetensors.rsync")
    new.write_bytes(_negated(weights, 48))
    os.utime(new, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns))
    os.replace(new, weights)


@pytest.mark.parametrize("rewrite", [_in_place, _cp_p, _rsync_a], ids=["in-place", "cp-p", "rsync-a"])
def test_weights_rewritten_with_the_mtime_restored_are_hashed_again(tiny_model_dir, tmp_path, monkeypatch, rewrite):
    monkeypatch.setattr(files, "RACY_NS", 0, raising=False)  # fresh files: remember their hash all the same
    model, hashes = tmp_path / "model", tmp_path / "hashes.json"
    shutil.copytree(tiny_model_dir, model)
    judged = cached_tree_hash(model, hashes)
    assert json.loads(hashes.read_text())[str(model.resolve())]["sha256"] == judged  # remembered
    weights = model / WEIGHTS
    before = weights.stat()
    _after_a_tick(weights, tmp_path / "tick")
    rewrite(weights, tmp_path)
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # what the old key saw
    assert cached_tree_hash(model, hashes) == sha256_tree(model) != judged


def test_an_entry_an_older_kiln_wrote_is_not_trusted(tiny_model_dir, tmp_path):
    """hashes.json keeps its format; an entry keyed by the old (path, size, mtime) signature never
    matches the new one, so it is hashed once more, not believed."""
    model, hashes = tmp_path / "model", tmp_path / "hashes.json"
    shutil.copytree(tiny_model_dir, model)
    tree = sorted(p for p in model.resolve().rglob("*") if p.is_file())
    old = hash_of([(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in tree])
    hashes.write_text(json.dumps({str(model.resolve()): {"signature": old, "sha256": "0" * 64}}))
    assert cached_tree_hash(model, hashes) == sha256_tree(model)


def test_a_tree_changed_within_the_clock_tick_is_not_remembered(tiny_model_dir, tmp_path, monkeypatch):
    """ctime is stamped from a coarse clock: a file changed just before it was hashed could change
    again in the same tick with nothing in its stat to show it. Its hash is returned, not remembered;
    a tree older than `RACY_NS` is remembered and then only stat'ed."""
    model, hashes = tmp_path / "model", tmp_path / "hashes.json"
    shutil.copytree(tiny_model_dir, model)
    digest = cached_tree_hash(model, hashes)
    assert digest == sha256_tree(model) and str(model.resolve()) not in json.loads(hashes.read_text())
    monkeypatch.setattr(files, "RACY_NS", 0)
    assert cached_tree_hash(model, hashes) == digest
    monkeypatch.setattr(files, "sha256_tree", lambda root: pytest.fail("a remembered tree was hashed again"))
    assert cached_tree_hash(model, hashes) == digest


def test_the_model_source_sees_new_bytes_behind_a_restored_mtime(tiny_model_dir, tmp_path, monkeypatch):
    from kiln.pipeline.recipe.model_source import resolve_model

    monkeypatch.setattr(files, "RACY_NS", 0, raising=False)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    judged = resolve_model(str(model), tmp_path).sha256
    _after_a_tick(model / WEIGHTS, tmp_path / "tick")
    _cp_p(model / WEIGHTS, tmp_path)
    assert resolve_model(str(model), tmp_path).sha256 == sha256_tree(model) != judged


def _stage(run_dir: Path, name: str) -> tuple[dict, Path]:
    """A run's record of a stage, and the artifact folder it points at."""
    record = json.loads((run_dir / "stages" / f"{name}.json").read_text())
    return record, Path(record["path"]) / "model"


def _artifact_sha(artifact: Path, scratch: Path) -> str:
    """The artifact's sha256 as its manifest records it: hashed before the manifest was written into it."""
    shutil.copytree(artifact, scratch, ignore=shutil.ignore_patterns("kiln-artifact.json"))
    return sha256_tree(scratch)


def _newest_run(work: Path) -> Path:
    return max((work / "runs").iterdir(), key=lambda p: p.stat().st_mtime)


def test_a_judged_checkpoint_rewritten_under_a_finished_run(tmp_path, tiny_model_dir):
    """The real CLI, twice. After the first run, new bytes go into the user's weights, in place and
    then by `cp` over them, the mtime restored each time: the baseline artifact the first run judged
    keeps its bytes and its manifest's sha256, and the second run hashes the new checkpoint and
    computes every optimize stage again instead of reusing the first run's."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    env = {"KILN_CACHE": str(fresh_cache(tmp_path / "cache"))}
    recipe = quick_recipe(tmp_path / "r.yaml", model, name="judged-bytes")
    first = kiln("run", str(recipe), cwd=tmp_path, env=env)
    assert first.returncode in (0, 1, 3), first.stdout[-3000:] + first.stderr[-3000:]
    _, baseline = _stage(_newest_run(tmp_path), "optimize-baseline")
    manifest = json.loads((baseline / "kiln-artifact.json").read_text())
    judged = manifest["source_sha256"]
    weights = model / WEIGHTS
    mtime = weights.stat().st_mtime_ns
    for rewrite in (_in_place, _cp_p):
        rewrite(weights, tmp_path)
        assert weights.stat().st_mtime_ns == mtime
        assert _artifact_sha(baseline, tmp_path / rewrite.__name__) == manifest["sha256"], rewrite.__name__
        assert (baseline / WEIGHTS).stat().st_ino != weights.stat().st_ino
    assert sha256_tree(model) != judged  # the premise: new weights behind the old (path, size, mtime)

    second = kiln("run", str(recipe), cwd=tmp_path, env=env)
    assert second.returncode in (0, 1, 3), second.stdout[-3000:] + second.stderr[-3000:]
    run_dir = _newest_run(tmp_path)
    for name in ("optimize-baseline", "optimize-candidate"):
        record, artifact = _stage(run_dir, name)
        source = json.loads((artifact / "kiln-artifact.json").read_text())["source_sha256"]
        assert not record["reused"] and source == sha256_tree(model) != judged, (name, record["reused"])
