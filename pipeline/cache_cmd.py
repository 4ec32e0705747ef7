"""`kiln cache`: what kiln's cache ($KILN_CACHE, else ~/.cache/kiln) holds, and pruning what no
run needs. The rules (what is needed, what last used means, how deleting stays atomic) are in
kiln.pipeline.cache_index. Registered on the one `kiln` app (cli_app.py) when `cli.py` imports it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Annotated

import typer

from kiln.pipeline.cli_app import JsonOpt, app, console, size_option, typer_app
from kiln.pipeline.cli_ops import TrackingOpt
from kiln.core.errors import BadInput

cache_app = typer_app(help="What kiln's cache holds (by model, stage and size; what is needed) and pruning the rest.")
app.add_typer(cache_app, name="cache")

RUN_DIR_TAG = "kiln.run_dir"  # set on a version by kiln.pipeline.model_registry.complete
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'7d', '12h', '30m', '2w', '90s' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text, re.IGNORECASE)
    if not m:
        raise BadInput(f"--older-than {text!r}: give an age such as 7d, 12h, 30m or 2w")
    return float(m[1]) * AGE_UNITS[m[2].lower()]


def registered_runs(uri: str | None) -> tuple[list[Path], str]:
    """The run folders of every registered model version in the tracking store (their
    `kiln.run_dir` tag), and a line saying where they came from."""
    from kiln.pipeline.tracking import default_uri, open_client, redact_uri

    uri = uri or default_uri()
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return [], f"no tracking store at {redact_uri(uri)}: no registered version is known here (--tracking-uri)"
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


def _index(tracking_uri: str | None):
    from kiln.pipeline.cache_index import index
    from kiln.pipeline.model_source import cache_root

    runs, note = registered_runs(tracking_uri)
    return index(cache_root(), runs), note


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit in ("w", "d", "h", "m"):
        if s >= AGE_UNITS[unit]:
            return f"{s / AGE_UNITS[unit]:.0f}{unit} ago"
    return f"{s:.0f}s ago"


@cache_app.command("list")
def list_cmd(tracking_uri: TrackingOpt = None,
             entries: Annotated[bool, typer.Option("--entries", help="a line per stage and engine")] = False,
             as_json: JsonOpt = False) -> None:
    """What the cache holds: stages and engines by model and kind, with their size and what is
    needed (a registered version's run, or a run or stage running now); the rest by folder."""
    from rich.table import Table

    from kiln.optimize.memory import human

    ix, note = _index(tracking_uri)
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
              tracking_uri: TrackingOpt = None) -> None:
    """Prune stages and engines no one needs, by age and/or total size. A dry run unless --yes:
    it prints what would go and what that frees. Never touches what a registered version's run
    or a running kiln run needs, nor the demo model, data or llama.cpp build; a prune killed
    half-way leaves no half stage (entries are renamed into trash/ first)."""
    from kiln.optimize.memory import human
    from kiln.pipeline.cache_index import plan_prune, prune

    if older_than is None and max_size is None:
        raise BadInput("kiln cache prune: say what to prune with --older-than AGE (7d) and/or --max-size SIZE (20G)")
    age = parse_age(older_than) if older_than is not None else None
    limit = size_option("--max-size", max_size)
    ix, note = _index(tracking_uri)
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
        list_cmd(tracking_uri=None, entries=False, as_json=False)
