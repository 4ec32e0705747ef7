"""The one `kiln` Typer app, its consoles and the arguments several commands share. cli.py, cli_ops.py
and cache_cmd.py register their commands on it; cli.py runs it (`main`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kiln.core.errors import BadInput

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="kiln: take an LLM checkpoint to production safely — optimize, evaluate, track, gate, deploy.")
console = Console(stderr=False)
err = Console(stderr=True)

RecipeArg = Annotated[Path, typer.Argument(help="recipe YAML file", show_default=False)]
SetOpt = Annotated[list[str], typer.Option("--set", help="override a recipe field: --set optimize.bits=8 (repeatable)")]
RunsOpt = Annotated[Path, typer.Option(help="where run directories go")]


def size_option(flag: str, value: str | None) -> int | None:
    """A size given on the command line (24G, 512M: powers of 1024) in bytes; None when not given.
    A size that does not parse is BadInput naming the option."""
    from kiln.optimize.memory import parse_bytes

    try:
        return parse_bytes(value) if value is not None else None
    except ValueError as e:
        raise BadInput(f"{flag}: {e}") from None
