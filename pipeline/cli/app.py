"""The one `kiln` Typer app, its consoles and the arguments several commands share. cli.py, cli_ops.py
and cache_cmd.py register their commands on it; cli.py runs it (`main`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kiln.core.errors import BadInput

# Every command answers -h as --help (click hands help_option_names down to subcommands). Markdown mode:
# typer's "rich" mode keeps a docstring's line breaks, so help broke mid-sentence at the source's width.
HELP_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}


def typer_app(**options: Any) -> typer.Typer:
    """A Typer app (the root or a group such as `kiln cache`) with kiln's help conventions."""
    return typer.Typer(no_args_is_help=True, rich_markup_mode="markdown", context_settings=HELP_SETTINGS, **options)


app = typer_app(pretty_exceptions_enable=False, add_completion=False,
                help="kiln: take an LLM checkpoint to production safely — optimize, evaluate, track, gate, deploy.")

# Without a terminal (CI logs, a pipe) rich assumes 80 columns and cuts table cells to fit ("opti…");
# there a line may be as long as its content. COLUMNS, when set, still decides.
_UNBOUNDED = 10_000


def _console(stderr: bool) -> Console:
    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c.width = _UNBOUNDED
    return c


console = _console(stderr=False)
err = _console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"kiln {version('kiln')}")
        raise typer.Exit(0)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print kiln's version and exit")] = False) -> None:
    """kiln: take an LLM checkpoint to production safely — optimize, evaluate, track, gate, deploy."""


JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document on stdout instead of the text")]

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML file", show_default=False)]
SetOpt = Annotated[list[str], typer.Option("--set", help="override a recipe field: --set optimize.bits=8 (repeatable)")]
# None: runs/ in kiln's home (kiln.core.home.runs_root), read when the command runs
RunsOpt = Annotated[Path | None, typer.Option(help="the folder of run folders (default: runs/ in kiln's home: "
                                                   "$KILN_HOME, else ~/.local/share/kiln)", show_default=False)]
FreshOpt = Annotated[list[str], typer.Option(help="recompute a stage even if cached: a stage name or 'all' (repeatable)")]
RunArg = Annotated[str, typer.Argument(metavar="RUN", help="a run's name under --runs, or its folder")]


def port_option(what: str) -> Any:
    """--port, saying what listens on it."""
    return typer.Option(help=f"TCP port {what} listens on")


def size_option(flag: str, value: str | None) -> int | None:
    """A size given on the command line (24G, 512M: powers of 1024) in bytes; None when not given.
    A size that does not parse is BadInput naming the option."""
    from kiln.optimize.memory import parse_bytes

    try:
        return parse_bytes(value) if value is not None else None
    except ValueError as e:
        raise BadInput(f"{flag}: {e}") from None
