"""kiln's two folders, whatever the current folder: its home (runs, the default tracking store and its
artifacts) and its cache (what can be rebuilt: stages, engines, llama.cpp, the demo's files).

    $KILN_HOME, else $XDG_DATA_HOME/kiln, else ~/.local/share/kiln
        runs/<run>/      one folder per `kiln run` (report, verdict, stage records)
        mlflow.db        the default MLflow store, unless $MLFLOW_TRACKING_URI or a recipe's tracking.uri names one
        mlruns/          that store's artifacts (any local sqlite store keeps them beside its .db file)

A user's runs used to land where they stood (./runs, ./mlflow.db and a ./mlruns of hundreds of MB),
and `kiln runs` from another folder found none. A per-user data folder, not a project root found by
walking up to the recipe: `kiln runs`, `show`, `serve` and `cache list` name no recipe, yet must find
the same runs. This is the one definition every command's default reads.

    $KILN_CACHE, else ~/.cache/kiln
        stages/, engines/, llama.cpp/, models/, data/, hashes.json, ...

The cache has other rules (`kiln cache` lists and prunes it), and one more reader:
core/llama_cpp_build.py, which the Makefile runs with Python's standard library alone before kiln is
installed, imports this file as a plain module. So this file imports nothing but the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "KILN_HOME"
CACHE_ENV = "KILN_CACHE"
STORE_FILE = "mlflow.db"
ARTIFACTS = "mlruns"  # MLflow's own name for a local artifact root


def kiln_home() -> Path:
    """$KILN_HOME, else $XDG_DATA_HOME/kiln, else ~/.local/share/kiln (the XDG default)."""
    if given := os.environ.get(HOME_ENV):
        return Path(given).expanduser().absolute()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data).expanduser().absolute() / "kiln"


def kiln_cache() -> Path:
    """kiln's one cache: $KILN_CACHE if set, else ~/.cache/kiln. Every stage, `kiln prepare-demo`, the
    llama.cpp build and its lookup, `make` and the test suite use it."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kiln").expanduser()


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
