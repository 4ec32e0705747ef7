"""Content-addressed stage execution: the mechanism behind caching, resume and MLflow children.

A stage's key is the hash of everything that decides its output (its config, the content hashes
of its inputs, the hardware for measurements). Its output is a folder under the cache, written
through `atomic_dir`: a stage killed half-way leaves only a `.partial` folder that the next run
discards, and a finished stage is never recomputed. Each execution (or reuse) is logged as a child
run of the pipeline's parent run.

A finished stage is sealed (kiln.pipeline.provenance.stage_evidence): the digests of its key's inputs and of every
file it wrote, signed. A copy is reused only once its seal checks (the cache's against this machine's
trusted keys; the tracking server's, fetched into scratch first, likewise); anything else is computed
again and said so, never trusted. A reuse logs its metrics and where it came from, never a second copy
of the files: the run that computed a stage is the one place its files are found by key.
"""

from __future__ import annotations

import fcntl
import filecmp
import glob
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from kiln.core import progress
from kiln.core.errors import NotVerified
from kiln.core.files import atomic_dir, atomic_write_json, file_lock, read_json
from kiln.core.units import amount
from kiln.pipeline.stages.rss import StageMemory, peak_rss_bytes  # noqa: F401 - peak_rss_bytes: stage_optimize and bench import it from here
from kiln.pipeline.provenance.stage_evidence import STAGE_FORMAT  # noqa: F401 - importable from here, where it was
from kiln.pipeline.provenance.stage_evidence import ENVELOPE, check, seal, stage_key
from kiln.pipeline.tracking.runs import CANDIDATE_TAG, REUSED, REUSED_FROM, STAGE_KEY, Tracker, flatten
from kiln.core.versions import environment

log = logging.getLogger("kiln")

RESULT = "result.json"
MANIFEST = "manifest.json"
LINK_MIN_BYTES = 64 * 1024  # smaller files are not worth a comparison: a stage's own records


def stage_lock(cache: Path, stage: str, key: str) -> Path:
    """Taken (exclusive) while a process computes or checks the stage: one at a time per key."""
    return cache / "locks" / stage / f"{key}.lock"


def stage_use(cache: Path, stage: str, key: str) -> Path:
    """Held shared by every running kiln run that used the stage (`StageHolds`); its mtime is
    when the stage was last used. `kiln cache prune` leaves a stage alone while it is held."""
    return cache / "locks" / stage / f"{key}.use"


class StageHolds:
    """The stages one run has used, each held with a shared lock on its `.use` file until the
    run's last context is gone (or its process ends): `kiln cache prune` cannot remove an
    optimize stage's model under the engine stage that builds from it, or an engine under the
    benchmark that measures it."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def hold(self, path: Path) -> None:
        if path not in self.fds:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            self.fds[path] = fd
        os.utime(path)  # last used: now

    def __del__(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


@dataclass
class RunContext:
    """Everything a stage may use, passed explicitly (no global state)."""

    recipe: Any
    recipe_path: Path
    run_dir: Path
    cache: Path
    tracker: Tracker
    parent_run: str
    console: Any
    fresh: set[str] = field(default_factory=set)
    made: set[str] = field(default_factory=set)  # stage keys computed in this run: `fresh` recomputes each once
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)
    arm: str = ""  # a search's candidate: names it in every stage's label
    gate: Any = None  # the policy the verdict is judged at (a search's family policy); None: recipe.gate
    holds: StageHolds = field(default_factory=StageHolds)  # shared by a search's per-arm copies


@dataclass(frozen=True)
class Found:
    """A finished copy of a stage whose seal checked here, and the MLflow run that computed it (None:
    not known, e.g. computed with no tracking run); `remote`: fetched from the tracking server now."""

    computed_by: str | None
    remote: bool = False


@dataclass
class StageOutcome:
    stage: str
    role: str
    key: str
    path: Path
    result: dict[str, Any]
    reused: bool
    mlflow_run: str


def run_tags(ctx: RunContext) -> dict[str, str]:
    """Tags on every MLflow run of one pipeline run: what ties it to its recipe, and what
    `Tracker.mark_stale` finds a killed run's leftovers by (with the host and pid every run has)."""
    return {"kiln.recipe": ctx.recipe.name, "kiln.recipe_hash": ctx.recipe.digest()}


def run_stage(ctx: RunContext, stage: str, role: str, inputs: dict[str, Any],
              compute: Callable[[Path], dict[str, Any]], artifacts: tuple[str, ...] = (),
              portable: bool = True, needs: Callable[[dict[str, Any]], list[Path]] | None = None) -> StageOutcome:
    """Return the stage's result, computing it only if no finished copy exists.

    `compute(out_dir)` writes files into out_dir and returns the result dict, whose "metrics"
    (flat name -> number) are logged to MLflow. `portable` stages (results only, no large local
    outputs such as checkpoints) log their whole folder and may be reused from another machine's
    run found in MLflow by its stage key, once its seal checks under a key trusted here; the others
    log their result, manifest, seal and `artifacts`, and are reused only from this cache, where
    their bytes are rehashed.
    """
    key = stage_key(stage, inputs)
    path = ctx.cache / "stages" / stage / key
    label = f"{ctx.arm + ': ' if ctx.arm else ''}{stage}[{role}]"

    def waiting() -> None:
        ctx.console.print(f"[dim]… {escape(label)}: another kiln run is computing it; waiting[/dim]")

    tags = {"kiln.stage": stage, "kiln.role": role, STAGE_KEY: key, **run_tags(ctx),
            **({CANDIDATE_TAG: ctx.arm} if ctx.arm else {})}  # a search's resume finds where each arm was built
    run_id = ctx.tracker.start(label, tags, parent=ctx.parent_run)
    try:
        # One process at a time per stage key: a second run on the same cache waits, then reuses
        # what the first computed, instead of computing it again and replacing files under a reader.
        with file_lock(stage_lock(ctx.cache, stage, key), on_wait=waiting):
            found = _reuse(ctx, label, stage, key, path, portable)
            if found and needs and (gone := [p for p in needs(read_json(path / RESULT)) if not p.exists()]):
                ctx.console.print(f"[yellow]! {escape(label)}: {escape(str(gone[0]))} is gone; computing the stage again[/yellow]")
                found = None
            if found:
                where = f" from the tracking server (run {found.computed_by})" if found.remote else ""
                ctx.console.print(f"[dim]✓ {escape(label)}: unchanged inputs, reusing {key[:12]}{where}[/dim]")
            else:
                _compute(ctx, label, key, inputs, compute, path, run_id=run_id)
                ctx.made.add(key)
            ctx.holds.hold(stage_use(ctx.cache, stage, key))  # before the lock goes: no prune in between
        result = _log_stage(ctx, run_id, stage, inputs, path, found, None if portable else artifacts)
        ctx.tracker.end(run_id)
    except BaseException as e:
        ctx.tracker.end(run_id, "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")  # Ctrl-C is no failure
        raise
    outcome = StageOutcome(stage, role, key, path, result, found is not None, run_id)
    ctx.outcomes[f"{stage}:{role}"] = outcome
    # computed_by: the run whose artifacts hold the stage's files (a reuse's own run holds none)
    atomic_write_json(ctx.run_dir / "stages" / f"{stage}-{role}.json",
                      {"stage": stage, "role": role, "key": key, "path": str(path), "reused": found is not None,
                       "mlflow_run": run_id, "computed_by": found.computed_by if found else run_id,
                       "metrics": result.get("metrics", {})})
    return outcome


def _log_stage(ctx: RunContext, run_id: str, stage: str, inputs: dict[str, Any], path: Path, found: Found | None,
               artifacts: tuple[str, ...] | None) -> dict[str, Any]:
    """The stage's MLflow run: its metrics, inputs as params, whether and whence it was reused, and,
    when computed here, its files (all of them when `artifacts` is None: a portable stage, which
    another machine reuses from these files alone). A reuse uploads nothing: a second copy would be
    a second place to find (and forge) the stage by its key. Returns the stage's result."""
    result, manifest = read_json(path / RESULT), read_json(path / MANIFEST)
    ctx.tracker.log(run_id, metrics={**_memory_of_older_stage(stage, manifest), **result.get("metrics", {}),
                                     "wall_s": manifest.get("wall_s", 0.0)},
                    params=flatten(inputs),
                    tags={REUSED: str(found is not None).lower(),
                          **({REUSED_FROM: found.computed_by} if found and found.computed_by else {})})
    if found:
        return result
    if artifacts is None:
        ctx.tracker.log_artifacts(run_id, path, "stage")
    else:
        for name in (RESULT, MANIFEST, ENVELOPE, *artifacts):
            if (path / name).exists():  # at its place in the folder, where its seal names it
                ctx.tracker.log_artifacts(run_id, path / name, "/".join(("stage", *Path(name).parent.parts)))
    return result


def _memory_of_older_stage(stage: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """A stage cached before its result held its peak memory: kiln's own peak from its manifest."""
    return {f"{stage}_peak_rss_bytes": manifest["peak_rss_bytes"]} if "peak_rss_bytes" in manifest else {}


def _reuse(ctx: RunContext, label: str, stage: str, key: str, path: Path, portable: bool) -> Found | None:
    """A finished copy of the stage whose seal checks: here, or for a portable stage on the tracking
    server, fetched into the cache now. A copy that does not check is said so and not used. A stage
    to be measured again (`fresh`) is computed once in this run: a search's arms that share it (the
    baseline's engine and quality stages) reuse what the first computed."""
    if (stage in ctx.fresh or "all" in ctx.fresh) and key not in ctx.made:
        return None
    reason = None
    if path.is_dir():
        try:
            check(path, stage, key, what="its cached copy")
            return Found(read_json(path / MANIFEST).get("mlflow_run"))
        except NotVerified as e:
            reason = str(e)
    source_run = ctx.tracker.find_stage(key) if portable else None
    if reason:
        _distrust(ctx, label, reason, "trying the tracking server's copy" if source_run else "computing it again")
    return _fetch(ctx, label, stage, key, path, source_run) if source_run else None


def _fetch(ctx: RunContext, label: str, stage: str, key: str, path: Path, source_run: str) -> Found | None:
    """The stage's files from the run that computed it, kept in the cache only once their seal checks."""
    try:
        with atomic_dir(path) as tmp:
            ctx.tracker.download(source_run, "stage", tmp)
            check(tmp, stage, key, what=f"the copy on the tracking server (run {source_run})")
        return Found(source_run, remote=True)
    except NotVerified as e:
        _distrust(ctx, label, str(e), "computing it here")
        return None


def _distrust(ctx: RunContext, label: str, reason: str, then: str) -> None:
    ctx.console.print(f"[yellow]! {escape(label)}: {escape(reason)}; {then}[/yellow]")
    log.warning("%s: %s; %s", label, reason, then)


def _compute(ctx: RunContext, label: str, key: str, inputs: dict[str, Any],
             compute: Callable[[Path], dict[str, Any]], path: Path, run_id: str | None = None) -> None:
    """Compute the stage into `path` (<cache>/stages/<stage>/<key>) and seal it. Its result's metrics
    gain the stage's peak resident memory, kiln's own and its child processes' (`<stage>_peak_rss_bytes`,
    `<stage>_children_peak_pss_bytes`: kiln.pipeline.stages.rss says what is counted); the manifest holds
    them with each child's, and the MLflow run (`run_id`) that computed it."""
    ctx.console.print(f"[bold]▶ {escape(label)}[/bold]")
    start = time.perf_counter()
    with atomic_dir(path) as tmp:
        # the stage's loops report to this task (kiln.core.progress): a bar on a terminal, else a line every ~10 s
        with StageMemory() as memory, progress.task(label, displays=progress.displays_for(ctx.console)):
            result = compute(tmp)
        link_equal_files(tmp, path.parent)
        wall = time.perf_counter() - start
        result["metrics"] = {**result.get("metrics", {}), **memory.metrics(path.parent.name)}
        atomic_write_json(tmp / RESULT, result)
        atomic_write_json(tmp / MANIFEST, {
            "stage": label, "key": key, "inputs": inputs, "wall_s": wall, **memory.figures(),
            "environment": environment(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mlflow_run": run_id,
        })
        seal(tmp, path.parent.name, key, inputs)
    metrics = result.get("metrics", {})
    shown = ", ".join(f"{k} {amount(k, v)}" for k, v in list(metrics.items())[:6] if isinstance(v, int | float))
    ctx.console.print(f"  done in {wall:.1f}s {shown}", markup=False)
    log.info("%s finished in %.1fs: %s", label, wall, json.dumps(metrics, default=str))


def link_equal_files(out: Path, kind_dir: Path) -> int:
    """Hard-link each file of the stage being written (`out`) to a byte-equal file at the same place in
    a finished stage of its kind (`kind_dir`: <cache>/stages/<stage>): the same bytes are kept once in
    the cache (issue 35), e.g. the tokenizer every optimize stage of one checkpoint copies beside its
    weights. Stage files are never changed in place (a stage is replaced whole), so sharing an inode
    is safe. Returns the bytes saved."""
    saved = 0
    for f in sorted(p for p in out.rglob("*") if p.is_file() and not p.is_symlink()):
        if f.stat().st_size >= LINK_MIN_BYTES and (twin := _equal_file(f, f.relative_to(out), kind_dir)):
            try:
                os.link(twin, f.with_name(f.name + ".link"))
            except OSError:  # pruned meanwhile, or links refused here: keep the copy
                continue
            os.replace(f.with_name(f.name + ".link"), f)
            saved += f.stat().st_size
    return saved


def _equal_file(f: Path, rel: Path, kind_dir: Path) -> Path | None:
    """A file at `rel` in a finished stage under `kind_dir` with the bytes of `f`, on another inode."""
    for other in sorted(kind_dir.glob(f"*/{glob.escape(str(rel))}")):
        stage = other.parents[len(rel.parts) - 1]
        if stage.name.endswith(".partial") or not (stage / RESULT).exists():
            continue  # being written, or left half-way: not a finished stage
        try:
            if other.stat().st_size == f.stat().st_size and not other.samefile(f) and filecmp.cmp(f, other, shallow=False):
                return other
        except OSError:  # pruned meanwhile
            continue
    return None
