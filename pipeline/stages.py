"""Content-addressed stage execution: the mechanism behind caching, resume and MLflow children.

A stage's key is the hash of everything that decides its output (its config, the content hashes
of its inputs, the hardware for measurements). Its output is a folder under the cache, written
through `atomic_dir`: a stage killed half-way leaves only a `.partial` folder that the next run
discards, and a finished stage is never recomputed. Each execution (or reuse) is logged as a child
run of the pipeline's parent run.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape

from kiln.pipeline.files import atomic_dir, atomic_write_json, file_lock, hash_of, read_json
from kiln.pipeline.tracking import STAGE_KEY, Tracker, flatten
from kiln.pipeline.versions import environment

log = logging.getLogger("kiln")

# Bump when a stage's output format or computation changes: old cache entries stop matching.
STAGE_FORMAT = 1
RESULT = "result.json"
MANIFEST = "manifest.json"


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
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)
    arm: str = ""  # a search's candidate: names it in every stage's label
    gate: Any = None  # the policy the verdict is judged at (a search's family policy); None: recipe.gate


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


def reset_peak_rss() -> None:
    """Start a new peak for `peak_rss_bytes`: Linux resets a process's VmHWM when "5" is written
    to its clear_refs. Stages run one after another in one process, so each stage's manifest
    holds its own peak, not the largest of every stage before it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or a kernel without it: the peak then covers the process so far
        pass


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident memory of a process (this one by default) since its last `reset_peak_rss` or
    its start: VmHWM, not getrusage's ru_maxrss, which Linux carries across fork and exec (a child
    of a 2 GB parent reports 2 GB)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        if pid != "self":
            raise
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: KiB on Linux
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


def run_stage(ctx: RunContext, stage: str, role: str, inputs: dict[str, Any],
              compute: Callable[[Path], dict[str, Any]], artifacts: tuple[str, ...] = (),
              portable: bool = True) -> StageOutcome:
    """Return the stage's result, computing it only if no finished copy exists.

    `compute(out_dir)` writes files into out_dir and returns the result dict, whose "metrics"
    (flat name -> number) are logged to MLflow. `portable` stages (results only, no large local
    outputs such as checkpoints) log their whole folder and may be reused from another machine's
    run found in MLflow by its stage key; the others log their result, manifest and `artifacts`.
    """
    key = hash_of({"stage": stage, "format": STAGE_FORMAT, "inputs": inputs})
    path = ctx.cache / "stages" / stage / key
    label = f"{ctx.arm + ': ' if ctx.arm else ''}{stage}[{role}]"

    def waiting() -> None:
        ctx.console.print(f"[dim]… {escape(label)}: another kiln run is computing it; waiting[/dim]")

    run_id = ctx.tracker.start(label, {"kiln.stage": stage, "kiln.role": role, STAGE_KEY: key, **run_tags(ctx)},
                               parent=ctx.parent_run)
    try:
        # One process at a time per stage key: a second run on the same cache waits, then reuses
        # what the first computed, instead of computing it again and replacing files under a reader.
        with file_lock(ctx.cache / "locks" / stage / f"{key}.lock", on_wait=waiting):
            reused, source_run = _reuse(ctx, stage, key, path, portable)
            if reused:
                where = f" from the tracking server (run {source_run})" if source_run else ""
                ctx.console.print(f"[dim]✓ {escape(label)}: unchanged inputs, reusing {key[:12]}{where}[/dim]")
            else:
                _compute(ctx, label, key, inputs, compute, path)
        result = read_json(path / RESULT)
        ctx.tracker.log(run_id, metrics={**result.get("metrics", {}), "wall_s": read_json(path / MANIFEST).get("wall_s", 0.0)},
                        params=flatten(inputs),
                        tags={"kiln.reused": str(reused).lower(), **({"kiln.reused_from": source_run} if source_run else {})})
        if portable:  # all of it: another machine reuses the stage from these files alone
            ctx.tracker.log_artifacts(run_id, path, "stage")
        else:
            for name in (RESULT, MANIFEST, *artifacts):
                if (path / name).exists():
                    ctx.tracker.log_artifacts(run_id, path / name, "stage")
        ctx.tracker.end(run_id)
    except BaseException:
        ctx.tracker.end(run_id, "FAILED")
        raise
    outcome = StageOutcome(stage, role, key, path, result, reused, run_id)
    ctx.outcomes[f"{stage}:{role}"] = outcome
    atomic_write_json(ctx.run_dir / "stages" / f"{stage}-{role}.json",
                      {"stage": stage, "role": role, "key": key, "path": str(path), "reused": reused,
                       "mlflow_run": run_id, "metrics": result.get("metrics", {})})
    return outcome


def _reuse(ctx: RunContext, stage: str, key: str, path: Path, portable: bool) -> tuple[bool, str | None]:
    """Whether a finished copy of the stage exists (here, or for a portable stage on the tracking
    server, fetched into the cache now), and the MLflow run it came from if fetched."""
    if stage in ctx.fresh or "all" in ctx.fresh:
        return False, None
    if (path / RESULT).exists():
        return True, None
    if portable and (source_run := ctx.tracker.find_stage(key)):
        with atomic_dir(path) as tmp:
            ctx.tracker.download(source_run, "stage", tmp)
        return True, source_run
    return False, None


def _compute(ctx: RunContext, label: str, key: str, inputs: dict[str, Any],
             compute: Callable[[Path], dict[str, Any]], path: Path) -> None:
    ctx.console.print(f"[bold]▶ {escape(label)}[/bold]")
    start = time.perf_counter()
    reset_peak_rss()
    with atomic_dir(path) as tmp:
        result = compute(tmp)
        wall = time.perf_counter() - start
        atomic_write_json(tmp / RESULT, result)
        atomic_write_json(tmp / MANIFEST, {
            "stage": label, "key": key, "inputs": inputs, "wall_s": wall,
            "peak_rss_bytes": peak_rss_bytes(), "environment": environment(),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
    metrics = result.get("metrics", {})
    shown = ", ".join(f"{k}={v:.4g}" for k, v in list(metrics.items())[:6] if isinstance(v, int | float))
    ctx.console.print(f"  done in {wall:.1f}s {shown}", markup=False)
    log.info("%s finished in %.1fs: %s", label, wall, json.dumps(metrics, default=str))
