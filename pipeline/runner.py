"""`kiln run`: the stages in order, each content-addressed, all tracked under one parent run.

optimize (baseline 'none', candidate) -> engine -> quality (perplexity, agreement)
-> benchmark (interleaved) -> gate -> report + registry.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape

from kiln.core.credentials import ScrubFilter
from kiln.core.errors import BadInput
from kiln.core.files import atomic_write_json, atomic_write_text, file_lock, hash_of, read_json
from kiln.core.gate.base import Verdict
from kiln.core.gate.policy import GateOutcome, judge
from kiln.core.home import kiln_cache
from kiln.core.versions import environment, git_commit
from kiln.pipeline.report import report
from kiln.pipeline.search import search
from kiln.pipeline.provenance.evidence import evidence_from_run
from kiln.pipeline.recipe.model_source import resolve_model
from kiln.pipeline.stages.outcomes import Ending, not_judged
from kiln.pipeline.stages.phases import up_to
from kiln.pipeline.recipe.schema import Recipe
from kiln.pipeline.stages.rss import settle
from kiln.pipeline.stages.evaluate import evaluate
from kiln.pipeline.stages.gate import gate
from kiln.pipeline.stages.inputs import check_inputs
from kiln.pipeline.stages.optimize import engine, optimize_both
from kiln.pipeline.stages.base import RunContext
from kiln.pipeline.tracking.runs import VERDICT, Tracker, flatten, process_tags, redact_uri, source_tags
from kiln.pipeline.tracking.runs import _alive as alive


def new_run_dir(root: Path, recipe: Recipe) -> Path:
    """A new run directory, created here: runs started in the same second (two CI jobs, two
    terminals) get `-2`, `-3`… rather than each other's folder."""
    base = Path(root) / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}-{recipe.digest()[:6]}"
    Path(root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory name under {root} for {base.name}")


def _log_to_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "kiln.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(ScrubFilter())
    logger = logging.getLogger("kiln")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


def _writable(folder: Path, field: str) -> Path:
    """`folder`, created if need be, once a file could be written in it; else BadInput naming `field`."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise BadInput(f"{field}: cannot write to {folder} ({e.strerror or e}); point it at a writable folder.") from None
    return folder


def start_run(recipe: Recipe, recipe_path: Path, runs_root: Path, console: Any, fresh: set[str],
              resume: bool = False) -> RunContext:
    """The run's folder and MLflow parent run. `resume` (`kiln run` without --new-run): the newest
    run folder of this recipe, if it was interrupted (Ctrl-C, a kill), is continued, with its parent
    run; its finished stages are reused from the cache as any run's are."""
    _writable(kiln_cache(), "KILN_CACHE")
    _writable(Path(runs_root), "--runs")
    tracker = Tracker(recipe.tracking.uri, recipe.tracking.experiment)  # an unreachable store fails before any work
    judged_under = check_policy(tracker.client, recipe)  # a model judged under another policy: before any work
    tracker.mark_stale({"kiln.recipe": recipe.name})  # parents and stages of a killed earlier attempt
    # One process at a time picks its folder: two runs started at once never both continue the same one.
    with file_lock(kiln_cache() / "locks" / f"runs-{hash_of(str(Path(runs_root).resolve()))[:16]}.lock"):
        run_dir = interrupted_run(runs_root, recipe, tracker) if resume else None
        parent = _continue(tracker, run_dir, console) if run_dir else None
        if parent is None:  # a new run: its own folder and MLflow run
            run_dir = new_run_dir(runs_root, recipe)
            tags = {"kiln.kind": "pipeline", "kiln.recipe": recipe.name, "kiln.recipe_hash": recipe.digest(),
                    "kiln.run_dir": str(run_dir.resolve()),
                    **source_tags(recipe_path, git_commit())}
            parent = tracker.start(run_dir.name, tags)
        (run_dir / "stages").mkdir()
        atomic_write_json(run_dir / "state.json", {
            "status": "running", "pid": os.getpid(), "mlflow_parent": parent, "tracking_uri": redact_uri(tracker.uri),
            "experiment_id": tracker.experiment_id, "recipe": str(recipe_path), "recipe_hash": recipe.digest(),
            "resumable": resume, "started_at": time.time()})
    resolved = recipe.model_dump(mode="json")
    atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(resolved, sort_keys=False))
    atomic_write_json(run_dir / "environment.json", environment())
    atomic_write_json(run_dir / POLICY_FILE, judged_under)
    tracker.log(parent, params=flatten(resolved))  # a continued run logs the same values again: MLflow accepts that
    tracker.log_artifacts(parent, run_dir / "recipe.yaml")
    tracker.log_artifacts(parent, run_dir / "environment.json")
    _log_to_file(run_dir)
    return RunContext(recipe=recipe, recipe_path=recipe_path, run_dir=run_dir, cache=kiln_cache(),
                      tracker=tracker, parent_run=parent, console=console, fresh=fresh)


def interrupted_run(runs_root: Path, recipe: Recipe, tracker: Tracker) -> Path | None:
    """The newest run folder of this recipe (its digest) under `runs_root`, if a `kiln run` started it
    and was interrupted (its state says killed, or running under a pid that is gone) on this tracking
    store; else None: a finished or failed run is a record, never continued."""
    mine = []
    for state_file in Path(runs_root).glob("*/state.json"):
        try:
            state = read_json(state_file)
        except (OSError, ValueError):  # a folder being written, or not kiln's
            continue
        if state.get("recipe_hash") == recipe.digest():
            mine.append((state.get("started_at", 0.0), state_file.parent, state))
    if not mine:
        return None
    _, run_dir, state = max(mine, key=lambda m: m[0])
    stopped = state.get("status") == "killed" or (state.get("status") == "running" and not _alive(state.get("pid", 0)))
    same_store = state.get("experiment_id") == tracker.experiment_id and state.get("tracking_uri") == redact_uri(tracker.uri)
    return run_dir if state.get("resumable") and stopped and same_store else None


def _continue(tracker: Tracker, run_dir: Path, console: Any) -> str | None:
    """Take over an interrupted run's folder and MLflow parent run (RUNNING again, owned by this
    process, so no other run's `mark_stale` ends it); its stage records and outputs are cleared: the
    stages are found again by key in the cache. None if its parent run is gone from the store."""
    parent = read_json(run_dir / "state.json").get("mlflow_parent")
    try:
        tracker.client.get_run(parent)
    except Exception:  # noqa: BLE001 - MLflow's own error types for a run that is not there
        return None
    tracker.log(parent, tags=process_tags())  # before RUNNING: another run's mark_stale must see a live pid
    if VERDICT in tracker.client.get_run(parent).data.tags:  # "Interrupted", from the attempt that was stopped
        tracker.client.delete_tag(parent, VERDICT)
    tracker.client.update_run(parent, status="RUNNING", name=run_dir.name)
    for p in run_dir.iterdir():
        if p.name not in ("kiln.log", "state.json"):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    console.print(f"[bold]continuing[/bold] the interrupted run {escape(str(run_dir))} (its finished stages are reused; "
                  "--new-run starts a new one)", soft_wrap=True)
    return parent


POLICY_FILE = "policy.json"  # the policy the run is judged under and its digest (report.publish attests it)


def check_policy(client: Any, recipe: Recipe) -> dict[str, Any]:
    """The recipe's policy and digest, once the registered model it registers under does not pin another
    (BadInput naming both and the ways forward; kiln.pipeline.tracking.registry)."""
    from kiln.pipeline.tracking.registry import pinned_policy, policy_mismatch, registered_name
    from kiln.pipeline.recipe.policy import policy, policy_digest

    digest, name = policy_digest(recipe), registered_name(recipe)
    pinned = pinned_policy(client, name)
    if pinned is not None and pinned.policy_sha256 != digest:
        raise BadInput(policy_mismatch(name, pinned, digest))
    return {"sha256": digest, "policy": policy(recipe), "registered_model": name}


def run_pipeline(recipe: Recipe, recipe_path: Path, runs_root: Path, console: Any,
                 fresh: set[str] = frozenset(), new_run: bool = False) -> tuple[GateOutcome, Path]:
    ctx = start_run(recipe, recipe_path, runs_root, console, set(fresh), resume=not new_run)
    try:
        model = resolve_model(recipe.model.path, ctx.cache)
        check_inputs(ctx, model)
        settle()  # what the checks left (the modules and the run's objects) is never walked again
        if recipe.candidates is None:
            arts = optimize_both(ctx, model)
            engines = {role: engine(ctx, role, art) for role, art in arts.items()}
            evaluate(ctx, engines)
            outcome, evidence = gate(ctx)
            report.publish(ctx, outcome, evidence, arts["candidate"])
        else:
            outcome = _search(ctx, model)
    except BaseException as e:
        _finish(ctx, "FAILED" if not isinstance(e, KeyboardInterrupt) else "KILLED", None)
        if isinstance(e, KeyboardInterrupt):  # the CLI says how to resume; this says what is kept
            console.print(f"\nstopped: {escape(str(ctx.run_dir))} is kept; `kiln run` of this recipe continues it",
                          soft_wrap=True)
        raise
    _finish(ctx, "FINISHED", outcome)
    return outcome, ctx.run_dir


def _search(ctx: RunContext, model: Any) -> GateOutcome:
    """Every candidate judged, the winner (or, with none, the one that got furthest) laid out in
    the run folder as a single-candidate run is, so `kiln show`, `kiln serve RUN` and the report
    read it the same way; each candidate keeps its own folder under candidates/. How the run ends
    is a row of kiln.pipeline.stages.outcomes."""
    winner, arms, policy = search.run_search(ctx, model)
    top = search.shown(arms, winner)
    stopped = [a.name for a in arms if a.budget]
    if top.artifact is None:  # no candidate could even be built: nothing to judge, register or publish
        atomic_write_json(ctx.run_dir / "search.json", report.search_record(arms, winner, policy))
        reasons = "\n".join(f"  {a.name}: {a.eliminated}" for a in arms)
        if stopped:
            raise search.NotJudged(f"not judged: the search budget ran out before any candidate was built:\n{reasons}")
        raise search.NothingBuilt("no candidate could be built:\n" + reasons)
    for record in sorted((top.ctx.run_dir / "stages").glob("*.json")):
        shutil.copyfile(record, ctx.run_dir / "stages" / record.name)
    ctx.outcomes.update(top.ctx.outcomes)
    winner_ctx = replace(ctx, recipe=top.ctx.recipe)
    if top is winner:
        # The winner is judged on every check, on its confirmation; against a champion, one more.
        kept = winner.versus_champion is not None and winner.versus_champion.verdict is Verdict.FAILED  # Error: exit 4
        extra = [winner.versus_champion] if winner.versus_champion else []
        subject = winner.name if not winner.eliminated or kept else f"{winner.name} (won the screening, then {winner.eliminated})"
        outcome, evidence = gate(
            winner_ctx, policy, results=judge(policy, *_arms(winner_ctx)).results + extra,
            ending=Ending.CHAMPION_KEPT if kept else Ending.JUDGED, subject=subject,
            detail=winner.eliminated or "")
    else:
        # No winner: the candidate that got furthest, on the checks its phases decided; every other
        # check of the policy is there too, not judged, so nothing that never ran can pass.
        decided = up_to(policy, top.reached or "build")
        judged = judge(decided, *_arms(winner_ctx)).results if decided else []
        rest = [not_judged(c, top.eliminated or "") for c in policy.checks if decided is None or c not in decided.checks]
        detail = (f"the search budget ({ctx.recipe.search.budget_s:g} s) ran out before every check of "
                  + ", ".join(stopped) + " ran") if stopped else ""
        outcome, evidence = gate(winner_ctx, policy, results=judged + rest,
                                 ending=Ending.BUDGET if stopped else Ending.NO_WINNER,
                                 subject=top.name, detail=detail)
    report.publish(winner_ctx, outcome, evidence, top.artifact, search=(arms, winner, policy))
    return outcome


def _arms(ctx: RunContext) -> tuple[Any, Any]:
    evidence = evidence_from_run(ctx.run_dir)
    return evidence["candidate"], evidence["baseline"]


def _finish(ctx: RunContext, status: str, outcome: GateOutcome | None) -> None:
    state = read_json(ctx.run_dir / "state.json")
    state.update(status="done" if outcome else status.lower(), finished_at=time.time())
    if outcome:
        state.update(verdict=outcome.verdict.value, exit_code=int(outcome.exit_code))
        ctx.tracker.show_verdict(ctx.parent_run, f"{report.ICON[outcome.verdict]} {outcome.verdict.value} · {ctx.run_dir.name}",
                                 outcome.verdict.value, passed=int(outcome.exit_code) == 0)
    atomic_write_json(ctx.run_dir / "state.json", state)
    ctx.tracker.end(ctx.parent_run, status)


def list_runs(runs_root: Path) -> list[dict[str, Any]]:
    out = []
    for d in sorted(Path(runs_root).glob("*/state.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        state = json.loads(d.read_text())
        state["run"] = d.parent.name
        if state.get("status") == "running" and not _alive(state.get("pid", 0)):
            state["status"] = "interrupted"
        out.append(state)
    return out


def _alive(pid: int) -> bool:
    return bool(pid) and alive(pid)


