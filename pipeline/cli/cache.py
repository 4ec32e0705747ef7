"""`kiln cache`: what kiln's cache ($KILN_CACHE, else ~/.cache/kiln) holds, and pruning what no
run needs. The rules (what is needed, what last used means, how deleting stays atomic) are in
kiln.pipeline.stages.cache_index; here, where the needs come from: the registered versions in every
tracking store the runs under --runs (kiln's home) used, each run's own (its state.json), not a
store in the current folder. Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline.cli.app import JsonOpt, RunsOpt, app, console, size_option, typer_app
from kiln.pipeline.cli.ops import TrackingOpt
from kiln.core.errors import BadInput

cache_app = typer_app(help="What kiln's cache holds (by model, stage and size; what is needed) and pruning the rest.")
app.add_typer(cache_app, name="cache")

RUN_DIR_TAG = "kiln.run_dir"  # set on a version by kiln.pipeline.tracking.registry.complete
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '2w', '90s' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text, re.IGNORECASE)
    if not m:
        raise BadInput(f"--older-than {text!r}: give an age such as 7d, 12h, 30m or 2w")
    return float(m[1]) * AGE_UNITS[m[2].lower()]


def registered_runs(uri: str) -> tuple[list[Path], str]:
    """The run folders of every registered model version in the tracking store `uri` (their
    `kiln.run_dir` tag), and a line saying where they came from."""
    from kiln.pipeline.tracking.runs import open_client, redact_uri

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return [], f"no tracking store at {redact_uri(uri)}"
    client = open_client(uri)
    runs: list[Path] = []
    versions, token = 0, None
    while True:
        page = client.search_model_versions(max_results=1000, page_token=token)
        versions += len(page)
        runs += [Path(mv.tags[RUN_DIR_TAG]) for mv in page if mv.tags.get(RUN_DIR_TAG)]
        token = page.token
        if not token:
            break
    missing = sum(not r.is_dir() for r in runs)
    where = f", {missing} of their run folders not on this machine" if missing else ""
    return runs, f"{versions} registered versions in {redact_uri(uri)}{where}"


def _states(runs: Path) -> dict[Path, dict]:
    """Each run folder under `runs` and its state.json."""
    out = {}
    for state in sorted(Path(runs).glob("*/state.json")):
        try:
            out[state.parent.resolve()] = json.loads(state.read_text())
        except (OSError, ValueError):  # a run being written, or not kiln's
            continue
    return out


def _stores(states: dict[Path, dict], uri: str | None) -> tuple[dict[str, list[Path]], list[str]]:
    """The tracking stores to read registered versions from, each with the run folders that used it:
    --tracking-uri alone when given, else the default store and every store a run here used (its
    state.json). A stored URI that held credentials was saved without them (`***@`): it is read
    through $MLFLOW_TRACKING_URI when that is the same store, else not at all, which is said."""
    from kiln.pipeline.tracking.runs import default_uri, redact_uri

    if uri:
        return {uri: []}, []
    stores: dict[str, list[Path]] = {default_uri(): []}
    notes = []
    env = os.environ.get("MLFLOW_TRACKING_URI")
    for run, state in states.items():
        used = state.get("tracking_uri")
        if used and "***@" in used:
            if not (env and redact_uri(env) == used):
                notes.append(f"run {run.name}'s store {used} (its credentials were not kept: set "
                             "$MLFLOW_TRACKING_URI to it to read its versions; its stages are kept meanwhile)")
                stores.setdefault(used, []).append(run)
                continue
            used = env
        if used:
            stores.setdefault(used, []).append(run)
    return stores, notes


def _needs(runs: Path, uri: str | None) -> tuple[dict[Path, str], dict[Path, dict], str]:
    """The run folders whose stages are needed (the runs of registered versions in the stores the
    runs used, and every run of a store that cannot be read) with why; the run folders' states;
    a line saying where the needs came from."""
    from kiln.pipeline.tracking.runs import redact_uri

    states = _states(runs)
    stores, notes = _stores(states, uri)
    needed: dict[Path, str] = {}
    for store, used_by in stores.items():
        if "***@" in store:
            needed.update({r: f"run {r.name}: its tracking store could not be read" for r in used_by})
            continue
        try:
            found, note = registered_runs(store)
        except BadInput as e:
            if uri:  # the store the user named: say so, as any command does
                raise
            needed.update({r: f"run {r.name}: its tracking store could not be read" for r in used_by})
            note = f"{redact_uri(store)} could not be read ({e}); its runs' stages are kept"
        needed.update({Path(r).resolve(): f"registered version's run {Path(r).name}" for r in found})
        notes.append(note)
    return needed, states, "; ".join(notes)


def _run_models(runs: list[Path]) -> dict[Path, str]:
    """Each run folder and the model it ran on: the model folder's name, as the manifests name it
    (`demo`: the demo checkpoint's folder)."""
    import yaml

    demo = None
    out = {}
    for run in runs:
        try:
            spec = str(yaml.safe_load((run / "recipe.yaml").read_text())["model"]["path"])
        except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
            continue
        if spec == "demo":
            demo = demo or _demo_name()
            out[run] = demo
        else:
            out[run] = Path(spec).name
    return out


def _demo_name() -> str:
    from kiln.pipeline.recipe.model_source import demo_model_folder

    try:
        folder = demo_model_folder(prepare=False)
    except Exception:  # noqa: BLE001 - the demo's package missing or broken: the recipe's word for it
        folder = None
    return folder.name if folder else "demo"


def _index(tracking_uri: str | None, runs: Path | None):
    from kiln.core.home import kiln_cache, runs_root
    from kiln.pipeline.stages.cache_index import index

    needed, states, note = _needs(runs_root(runs), tracking_uri)
    return index(kiln_cache(), needed, _run_models([*states, *needed])), note


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit in ("w", "d", "h", "m"):
        if s >= AGE_UNITS[unit]:
            return f"{s / AGE_UNITS[unit]:.0f}{unit} ago"
    return f"{s:.0f}s ago"


@cache_app.command("list")
def list_cmd(tracking_uri: TrackingOpt = None, runs: RunsOpt = None,
             entries: Annotated[bool, typer.Option("--entries", help="a line per stage and engine")] = False,
             as_json: JsonOpt = False) -> None:
    """What the cache holds: stages and engines by the model their runs ran on and by kind, with their
    size and what is needed (a registered version's run in a store the runs used, or a run or stage
    running now); the rest by folder."""
    from rich.table import Table

    from kiln.optimize.memory import human

    ix, note = _index(tracking_uri, runs)
    if as_json:  # every entry, whether or not --entries
        print(json.dumps(_as_dict(ix, note), indent=2))
        return
    console.print(f"{ix.root}: {human(ix.total)} on disk ({note})", soft_wrap=True)
    groups: dict[tuple[str, str], list] = {}
    for e in ix.entries.values():
        groups.setdefault((e.model, e.kind if e.finished else f"{e.kind} (unfinished)"), []).append(e)
    t = Table("model", "stage", "entries", "size", "needed", "last used", title="stages and engines (prunable)")
    for (model, kind), es in sorted(groups.items()):
        needed = [e for e in es if e.needed]
        t.add_row(model, kind, str(len(es)), human(sum(e.bytes for e in es)),
                  f"{len(needed)} ({human(sum(e.bytes for e in needed))})" if needed else "—",
                  _ago(max(e.last_used for e in es)))
    console.print(t)
    if entries:
        t = Table("stage", "key", "model", "size", "last used", "needed because", title="entries")
        for e in sorted(ix.entries.values(), key=lambda e: (e.model, e.kind, -e.last_used)):
            t.add_row(e.kind if e.finished else f"{e.kind} (unfinished)", e.key[:12], e.model, human(e.bytes),
                      _ago(e.last_used), e.needed or "—")
        console.print(t)
    t = Table("folder", "size", title="never pruned (inputs and tools)")
    for name, size in sorted(ix.other.items()):
        t.add_row(name, human(size))
    console.print(t)


def _as_dict(ix, note: str) -> dict:
    entries = [{"stage": e.kind, "key": e.key, "model": e.model, "path": str(e.path), "finished": e.finished,
                "bytes": e.bytes, "last_used": e.last_used, "needed": e.needed or None}
               for e in sorted(ix.entries.values(), key=lambda e: (e.model, e.kind, -e.last_used))]
    return {"root": str(ix.root), "total_bytes": ix.total, "needs_from": note, "entries": entries,
            "never_pruned": dict(sorted(ix.other.items()))}


@cache_app.command("prune")
def prune_cmd(older_than: Annotated[str | None, typer.Option(help="prune what was last used longer ago than this "
                                                                   "(7d, 12h, 30m)")] = None,
              max_size: Annotated[str | None, typer.Option(help="then prune the least recently used until the "
                                                                 "whole cache is at most this (20G, 500M)")] = None,
              yes: Annotated[bool, typer.Option("--yes", help="delete; without it nothing is deleted")] = False,
              tracking_uri: TrackingOpt = None, runs: RunsOpt = None) -> None:
    """Prune stages and engines no one needs, by age and/or total size. A dry run unless --yes:
    it prints what would go and what that frees. Never touches what a registered version's run
    or a running kiln run needs, nor the demo model, data or llama.cpp build; a prune killed
    half-way leaves no half stage (entries are renamed into trash/ first)."""
    from kiln.optimize.memory import human
    from kiln.pipeline.stages.cache_index import plan_prune, prune

    if older_than is None and max_size is None:
        raise BadInput("kiln cache prune: say what to prune with --older-than AGE (7d) and/or --max-size SIZE (20G)")
    age = parse_age(older_than) if older_than is not None else None
    limit = size_option("--max-size", max_size)
    ix, note = _index(tracking_uri, runs)
    doomed = plan_prune(ix, age, limit)
    freed = ix.freed({e.path for e in doomed})
    for e in doomed:
        console.print(f"  {e.kind:10} {e.key[:12]}  {e.model:24} {human(e.bytes):>10}  last used {_ago(e.last_used)}",
                      markup=False)
    head = f"{len(doomed)} of {len(ix.entries)} stages and engines, freeing {human(freed)} " \
           f"({human(ix.total)} -> {human(ix.total - freed)}); {note}"
    if not yes:
        console.print(f"would prune {head}. Nothing deleted: add --yes to delete.", soft_wrap=True)
        return
    deleted, kept = prune(ix, doomed)
    now = ix.total - ix.freed({e.path for e in deleted})
    console.print(f"pruned {len(deleted)} of {len(ix.entries)} stages and engines"
                  + (f"; kept {len(kept)} a kiln process took meanwhile" if kept else "")
                  + f"; {ix.root} is now {human(now)}", soft_wrap=True)
    if limit is not None and now > limit:
        console.print(f"[yellow]still over --max-size {max_size}: what is left is needed or never pruned "
                      "(kiln cache list)[/yellow]")


@cache_app.callback(invoke_without_command=True)
def cache_main(ctx: typer.Context) -> None:
    """`kiln cache` alone lists (`kiln cache list`)."""
    if ctx.invoked_subcommand is None:
        list_cmd(tracking_uri=None, runs=None, entries=False, as_json=False)
