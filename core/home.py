"""kiln's home: where runs, the default tracking store and its artifacts live, whatever the current folder.

    $KILN_HOME, else $XDG_DATA_HOME/kiln, else ~/.local/share/kiln
        runs/<run>/      one folder per `kiln run` (report, verdict, stage records)
        mlflow.db        the default MLflow store, unless $MLFLOW_TRACKING_URI or a recipe's tracking.uri names one
        mlruns/          that store's artifacts (any local sqlite store keeps them beside its .db file)

A user's runs used to land where they stood (./runs, ./mlflow.db and a ./mlruns of hundreds of MB),
and `kiln runs` from another folder found none. A per-user data folder, not a project root found by
walking up to the recipe: `kiln runs`, `show`, `serve` and `cache list` name no recipe, yet must find
the same runs. This is the one definition every command's default reads. kiln's *cache* (stages,
engines, llama.cpp) is another folder with other rules: `llama_cpp_build.kiln_cache`.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "KILN_HOME"
STORE_FILE = "mlflow.db"
ARTIFACTS = "mlruns"  # MLflow's own name for a local artifact root


def kiln_home() -> Path:
    """$KILN_HOME, else $XDG_DATA_HOME/kiln, else ~/.local/share/kiln (the XDG default)."""
    if given := os.environ.get(HOME_ENV):
        return Path(given).expanduser().absolute()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data).expanduser().absolute() / "kiln"


def runs_root(given: Path | None = None) -> Path:
    """The folder of run folders: `given` (a command's --runs) when set, else <home>/runs."""
    return Path(given) if given is not None else kiln_home() / "runs"


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the home's sqlite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{kiln_home() / STORE_FILE}"


def sqlite_artifacts(uri: str) -> Path | None:
    """Where a local sqlite store's artifacts go: `mlruns/` beside its .db file. MLflow's own default
    is ./mlruns of whatever folder the process started in. None for any other store, whose server or
    database keeps its own artifact root."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///")).absolute().parent / ARTIFACTS


def where_hint() -> str:
    """How to look elsewhere, for a command that found no run: runs started with --runs, or under
    another home."""
    return f"name their folder with --runs FOLDER, or set ${HOME_ENV} (now {kiln_home()}) to the home they ran under"
