"""`kiln cache`: list what the cache holds and prune by age or size, never what is needed."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kiln.pipeline.stages.cache_index import index, plan_prune, prune
from tests.pipeline.conftest import kiln

MB = 1 << 20
DAY = 86400
NOW = time.time()


class Cache:
    """A cache of stages and engines with known sizes and ages, as kiln lays them out."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.model = root.parent / "my-model"

    def optimize(self, key: str, mb: int, age_days: float) -> Path:
        d = self.root / "stages" / "optimize" / key
        (d / "model").mkdir(parents=True)
        (d / "model" / "model.safetensors").write_bytes(b"\1" * (mb * MB))
        manifest = {"source": str(self.model), "sha256": f"art-{key}", "source_sha256": "model-sha"}
        (d / "result.json").write_text(json.dumps({"metrics": {}, "manifest": manifest}))
        (d / "manifest.json").write_text(json.dumps({"inputs": {"source": "model-sha"}}))
        return self._age(d, age_days)

    def engine(self, key: str, artifact: Path | None, age_days: float) -> Path:
        d = self.root / "engines" / key
        d.mkdir(parents=True)
        source = {"path": str(artifact / "model"), "sha256": f"art-{artifact.name}"} if artifact else {}
        (d / "kiln-engine.json").write_text(json.dumps({"backend": "torch", "source": source}))
        return self._age(d, age_days)

    def stage(self, kind: str, key: str, age_days: float, engine: Path | None = None, mb: int = 0) -> Path:
        d = self.root / "stages" / kind / key
        d.mkdir(parents=True)
        result = {"metrics": {}, **({"engine_dir": str(engine)} if kind == "engine" and engine else {})}
        (d / "result.json").write_text(json.dumps(result))
        (d / "manifest.json").write_text(json.dumps({"inputs": {"engine": engine.name if engine else None}}))
        if mb:
            (d / "samples.jsonl").write_bytes(b"\1" * (mb * MB))
        return self._age(d, age_days)

    @staticmethod
    def _age(d: Path, days: float) -> Path:
        os.utime(d, (NOW - days * DAY, NOW - days * DAY))
        return d


def registered_run(tmp: Path, *stages: Path) -> Path:
    """A run folder as kiln writes it: one record per stage, naming its cache folder."""
    run = tmp / "runs" / "20261201-tiny"
    (run / "stages").mkdir(parents=True)
    for s in stages:
        (run / "stages" / f"{s.parent.name}-candidate.json").write_text(
            json.dumps({"stage": s.parent.name, "key": s.name, "path": str(s)}))
    return run


@pytest.fixture
def cache(tmp_path):
    """old:     a 3 MB artifact, its engine and engine stage, a 1 MB quality result (10 days)
    registered: a 2 MB artifact, its engine and engine stage a registered version's run lists (20 days)
    locked:     a 5 MB artifact another process is computing (its lock held; 30 days)
    recent:     a 4 MB artifact used an hour ago
    orphan:     an engine no stage names (10 days)"""
    c = Cache(tmp_path / "cache")
    c.old = c.optimize("old", 3, 10)
    c.old_engine = c.engine("e-old", c.old, 10)
    c.old_engine_stage = c.stage("engine", "s-old", 10, c.old_engine)
    c.old_quality = c.stage("quality", "q-old", 10, c.old_engine, mb=1)
    c.reg = c.optimize("reg", 2, 20)
    c.reg_engine = c.engine("e-reg", c.reg, 20)
    c.reg_engine_stage = c.stage("engine", "s-reg", 20, c.reg_engine)
    c.locked = c.optimize("locked", 5, 30)
    c.recent = c.optimize("recent", 4, 1 / 24)
    c.orphan = c.engine("e-orphan", None, 10)
    c.run = registered_run(tmp_path, c.reg_engine_stage)
    return c


@pytest.fixture
def lock(cache):
    """Hold the locked artifact's stage lock as a computing kiln process does."""
    path = cache.root / "locks" / "optimize" / "locked.lock"
    path.parent.mkdir(parents=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _left(cache: Cache) -> set[str]:
    return {p.name for p in [*cache.root.glob("stages/*/*"), *cache.root.glob("engines/*")]}


def test_needed_is_what_a_registered_run_or_a_running_stage_needs(cache, lock):
    ix = index(cache.root, [cache.run])
    needed = {p.name: e.needed for p, e in ix.entries.items() if e.needed}
    assert set(needed) == {"s-reg", "e-reg", "reg", "locked", "e-orphan"}
    assert needed["s-reg"].startswith("registered version's run 20261201-tiny")
    assert needed["e-reg"] == "needed by engine s-reg" and needed["reg"] == "needed by engine folder e-reg"
    assert needed["locked"] == "a kiln process is computing or checking it"
    assert needed["e-orphan"].startswith("a stage is computing")  # it may be the engine being built
    assert {e.model for e in ix.entries.values()} == {"my-model", "?"}  # the orphan names no source
    assert ix.entries[cache.old].bytes >= 3 * MB and ix.entries[cache.old_quality].bytes >= MB


def test_prune_by_age_keeps_exactly_what_it_must(cache, lock):
    ix = index(cache.root, [cache.run])
    deleted, kept = prune(ix, plan_prune(ix, older_than_s=7 * DAY, max_bytes=None))
    assert kept == []
    assert {e.path.name for e in deleted} == {"old", "e-old", "s-old", "q-old"}
    assert _left(cache) == {"reg", "e-reg", "s-reg", "locked", "recent", "e-orphan"}
    assert not any((cache.root / "trash").iterdir())


def test_prune_by_size_takes_the_least_recently_used_first(cache, lock):
    ix = index(cache.root, [cache.run])
    oldest_chain = ix.freed({cache.old, cache.old_engine, cache.old_engine_stage, cache.old_quality})
    assert oldest_chain >= 4 * MB
    # Room for all but the 10-day-old chain: exactly that goes, not the hour-old artifact.
    deleted, _ = prune(ix, plan_prune(ix, older_than_s=None, max_bytes=ix.total - oldest_chain))
    assert {e.path.name for e in deleted} == {"old", "e-old", "s-old", "q-old"}
    # A limit nothing unneeded can reach: everything unneeded goes, and nothing needed.
    deleted, _ = prune(index(cache.root, [cache.run]), plan_prune(index(cache.root, [cache.run]), None, 0))
    assert {e.path.name for e in deleted} == {"recent"}
    assert _left(cache) == {"reg", "e-reg", "s-reg", "locked", "e-orphan"}


def test_an_orphan_engine_goes_once_nothing_is_computing(cache):
    ix = index(cache.root, [cache.run])
    assert {e.path.name for e in plan_prune(ix, 7 * DAY, None)} == {"old", "e-old", "s-old", "q-old", "e-orphan",
                                                                    "locked"}


def test_an_artifact_in_use_through_its_engine_is_as_recent_as_its_engine_stage(cache):
    os.utime(cache.old_engine_stage, (NOW, NOW))  # a run used the engine stage just now
    ix = index(cache.root, [])
    chosen = {e.path.name for e in plan_prune(ix, 7 * DAY, None)}
    assert {"old", "e-old", "s-old"}.isdisjoint(chosen)
    assert "q-old" in chosen


def test_a_stage_a_running_run_used_is_kept_until_the_run_ends(tmp_path):
    from rich.console import Console

    from kiln.pipeline.stages.base import RunContext, run_stage

    tracker = SimpleNamespace(start=lambda *a, **k: "run", log=lambda *a, **k: None, end=lambda *a, **k: None,
                              log_artifacts=lambda *a, **k: None, find_stage=lambda key: None)
    recipe = SimpleNamespace(name="r", digest=lambda: "d")
    ctx = RunContext(recipe, tmp_path / "r.yaml", tmp_path / "run", tmp_path / "cache", tracker, "parent",
                     Console(quiet=True))
    outcome = run_stage(ctx, "quality", "candidate", {"x": 1}, lambda out: {"metrics": {}})
    os.utime(outcome.path, (NOW - 30 * DAY, NOW - 30 * DAY))
    (entry,) = index(tmp_path / "cache").entries.values()
    assert entry.needed == "a running kiln run uses it"
    assert NOW - entry.last_used < DAY  # used now, though finished 30 days ago
    del ctx  # the run is over
    (entry,) = index(tmp_path / "cache").entries.values()
    assert entry.needed == ""


def test_cli_dry_run_by_default_then_yes(cache, tmp_path):
    env = {"KILN_CACHE": str(cache.root), "COLUMNS": "200", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/none.db"}
    (cache.root / "trash" / "stage-left-by-a-killed-prune").mkdir(parents=True)
    listing = kiln("cache", "list", "--entries", cwd=tmp_path, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "my-model" in listing.stdout and "no tracking store" in listing.stdout
    dry = kiln("cache", "prune", "--older-than", "7d", cwd=tmp_path, env=env)
    assert dry.returncode == 0, dry.stderr
    assert "would prune 9 of 10" in " ".join(dry.stdout.split()) and "add --yes" in dry.stdout
    assert len(_left(cache)) == 10
    done = kiln("cache", "prune", "--older-than", "7d", "--yes", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    # No registered version known here: the registered run's artifact goes too; the recent one stays.
    assert _left(cache) == {"recent"}
    assert not any((cache.root / "trash").iterdir())


def test_cli_keeps_a_registered_version_s_run(cache, tmp_path):
    from kiln.pipeline.tracking.runs import open_client

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = open_client(uri)
    client.create_registered_model("tiny")
    client.create_model_version("tiny", source=str(cache.reg / "model"), tags={"kiln.run_dir": str(cache.run)})
    env = {"KILN_CACHE": str(cache.root), "MLFLOW_TRACKING_URI": uri}
    done = kiln("cache", "prune", "--max-size", "0", "--yes", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert _left(cache) == {"reg", "e-reg", "s-reg"}
    assert "still over --max-size 0" in done.stdout


@pytest.mark.parametrize("args, message", [
    ((), "say what to prune with --older-than AGE (7d) and/or --max-size SIZE (20G)"),
    (("--older-than", "a week"), "--older-than 'a week': give an age such as 7d"),
    (("--max-size", "big"), "--max-size: 'big': give a size such as 24G"),
])
def test_cli_bad_input(tmp_path, args, message):
    proc = kiln("cache", "prune", *args, cwd=tmp_path, env={"KILN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and message in " ".join(proc.stderr.split()), proc.stderr
