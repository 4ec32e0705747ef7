"""MLflow tracking: one parent run per pipeline run, one nested child run per stage.

Uses `MlflowClient` with explicit run ids (no global active-run state), so a resumed run can
re-attach to its parent and stages can be logged in any order. Stage results are also found again
by tag (`kiln.stage_key`), so a fresh machine pointed at the same tracking server reuses the
baseline's results instead of recomputing them.

Opening a store probes it first (an unreachable server is exit 2 in seconds, not MLflow's minutes
of retries), creates a new sqlite store under a lock (two runs at once would both migrate it), and
remembers any credential in the URI so that nothing kiln writes or prints shows it
(`kiln.core.credentials`).

What the MLflow UI shows without configuring is kiln's to fill: the parent run's name and a
`kiln.passed` metric carry the verdict (or say that the run was interrupted before one), its metrics
the deciding figures (speed-up and interval, quality deltas, cost: kiln.pipeline.report.report.run_figures),
its Dataset column the evaluation data, its Source column the recipe and the commit; the links kiln
prints open the runs table on pipeline runs alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
import urllib.parse
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.core import credentials, home
from kiln.core.errors import BadInput
from kiln.core.metrics import COST_PER_1M, SPEEDUP, delta_figure, interval_figures, ratio_figure

STAGE_KEY = "kiln.stage_key"
REUSED = "kiln.reused"  # 'false' on the one run that computed a stage (and holds its files), 'true' on a reuse
REUSED_FROM = "kiln.reused_from"  # on a reuse: the run that computed the stage, when known
CANDIDATE_TAG = "kiln.candidate"  # a search candidate's run and each of its stage runs
VERDICT = "kiln.verdict"
PASSED = "kiln.passed"  # 1 when the run's verdict is a pass (exit 0), else 0: a column the runs table sorts by
# MLflow 3's experiment kind. Its 3.17 UI takes the kind from a per-browser switch (GenAI / Model
# training, GenAI until the user flips it) instead, which a link selects with UI_VIEW.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
UI_VIEW = "workflowType=machine_learning"
KIND = "kiln.kind"  # 'pipeline' on a pipeline run's parent; its stage and candidate runs are its children
# The runs table a link kiln prints opens is a view MLflow keeps in an experiment tag (its "shared
# view", VIEW_TAG, chosen by the link's viewStateShareKey): pipeline runs only, counted as such ("5
# matching runs", not 69 with every stage; a run's page lists its child runs), the verdict and the
# deciding figures as its first columns (`view`). A link with any search field of its own would not
# load the view, so the filter is in the view.
PIPELINE_RUNS = f"tags.`{KIND}` = 'pipeline'"
VIEW_KEY = "kiln"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
VIEW_FIGURES = (PASSED, SPEEDUP, *interval_figures(SPEEDUP), delta_figure("perplexity"), ratio_figure("size_bytes"),
                f"{COST_PER_1M}.candidate", f"{COST_PER_1M}.baseline")  # a run's own figures join them (show_figures)
VIEW_ATTRIBUTES = ("Dataset", "Source")  # after the figures: the evaluation data, the recipe
# A pipeline run that ended without a verdict says so where a verdict would be (its name's first word,
# VERDICT): MLflow draws KILLED and FAILED with the same red icon, and a gate failure's name says Failed.
UNJUDGED = {"KILLED": ("⏹", "Interrupted"), "FAILED": ("⛔", "Not judged")}
PROBE_TIMEOUT_S = 5.0
DB_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def default_uri() -> str:
    """$MLFLOW_TRACKING_URI, else kiln's home store (kiln.core.home), whatever the current folder."""
    return home.default_tracking_uri()


def redact_uri(uri: str) -> str:
    """A tracking URI without credentials (`https://user:pass@host` -> `https://***@host`):
    URIs end up in run directories, reports and PR comments."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri


def experiment_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table in the MLflow UI (not its GenAI overview), in kiln's view."""
    return f"{redact_uri(base).rstrip('/')}/#/experiments/{experiment_id}/runs?{UI_VIEW}&viewStateShareKey={VIEW_KEY}"


def view(figures: tuple[str, ...] | list[str]) -> str:
    """The value of VIEW_TAG: the runs table's search fields and columns as MLflow's UI stores a
    shared view (its selectedColumns and columnOrder name a column `metrics.`name``)."""
    columns = [f"metrics.`{f}`" for f in figures] + [f"attributes.`{a}`" for a in VIEW_ATTRIBUTES]
    return json.dumps({"searchFilter": PIPELINE_RUNS, "selectedColumns": columns, "columnOrder": columns})


def view_figures(value: str | None) -> list[str]:
    """The figures a VIEW_TAG value shows as columns (none for a value that is not kiln's)."""
    try:
        columns = json.loads(value or "{}").get("selectedColumns", [])
    except (ValueError, AttributeError):
        return []
    return [c[len("metrics.`"):-1] for c in columns if isinstance(c, str) and c.startswith("metrics.`")]


def source_tags(recipe_path: Path, commit: str | None) -> dict[str, str]:
    """The recipe and the commit, in the tags MLflow's Source column reads."""
    return {"mlflow.source.name": str(recipe_path), "mlflow.source.type": "LOCAL",
            "mlflow.source.git.commit": commit or "unknown"}


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list) and v and all(isinstance(i, Mapping) for i in v):
            for i, item in enumerate(v):
                out.update(flatten(item, f"{key}.{i}."))
        else:
            out[key] = v
    return out


def process_tags() -> dict[str, str]:
    """Which process on which machine owns a run: a RUNNING run is stale only when its own host
    says that pid is gone (another machine's pid means nothing here)."""
    return {"kiln.host": socket.gethostname(), "kiln.pid": str(os.getpid())}


def probe(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Fail in seconds, not minutes, when a tracking server or database cannot be reached:
    MLflow's own client retries a refused connection for over four minutes (HTTP) or about two
    (a database URI) before it says so. Only reachability is checked here; what the server then
    answers (credentials, permissions) MLflow reports itself."""
    parsed = urllib.parse.urlsplit(uri)
    scheme = parsed.scheme.split("+", 1)[0]
    if scheme not in ("http", "https") and scheme not in DB_PORTS:
        return  # a local file store, sqlite, databricks profiles…
    fix = ("Check that the server is running and the address is right (recipe field tracking.uri, "
           "or $MLFLOW_TRACKING_URI), or leave both unset to use the local sqlite store.")
    try:
        if scheme in DB_PORTS:
            socket.create_connection((parsed.hostname or "localhost", parsed.port or DB_PORTS[scheme]), timeout_s).close()
        else:
            import requests

            requests.get(f"{uri.rstrip('/')}/health", timeout=(timeout_s, timeout_s))
    except (OSError, ValueError) as e:  # requests' errors are OSErrors too
        what = "database" if scheme in DB_PORTS else "MLflow tracking server"
        raise BadInput(f"tracking.uri: cannot reach the {what} at {redact_uri(uri)} ({_reason(e)}). {fix}") from None


def _reason(e: Exception) -> str:
    """The root cause of a connection failure in a few words (no URL: it may carry credentials)."""
    text = str(e)
    for known in ("Connection refused", "timed out", "Name or service not known", "No route to host",
                  "Temporary failure in name resolution", "certificate verify failed"):
        if known in text:
            return known.lower()
    return type(e).__name__


def open_client(uri: str | None = None) -> Any:
    """An MlflowClient on `uri` (default: `default_uri()`) whose store has
    been reached once: an HTTP server answered, or a sqlite file was created and migrated under a
    lock (two runs opening a fresh store at once would both run its migrations)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow.tracking import MlflowClient

    from kiln.core.files import file_lock

    uri = uri or default_uri()
    credentials.remember_uri(uri)
    probe(uri)
    db = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
    try:
        with file_lock(Path(db + ".kiln-lock")) if db else contextlib.nullcontext():
            if db and not Path(db).exists():
                _seed_sqlite(Path(db))
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)  # creates and migrates a new store
            client.search_registered_models(max_results=1)  # and the registry's tables, on first use
    except Exception as e:  # noqa: BLE001 - any backend failure here means a bad URI
        raise BadInput(f"tracking.uri: cannot open MLflow store {redact_uri(uri)!r}: {e}") from None
    return client


def _seed_sqlite(db: Path) -> None:
    """Start a new sqlite store as a copy of an empty, already migrated one: MLflow's migrations
    take ~8 s of CPU per new store (every new working folder's first `kiln run`), a copy 0.01 s.
    The template has no experiment rows, so MLflow creates its Default experiment in the new
    store's own place, as for a store it made itself. One template per MLflow version, built the
    first time under a lock; if anything about it fails, MLflow creates the store as before."""
    import sqlite3

    import mlflow

    from kiln.core.files import file_lock
    from kiln.core.home import kiln_cache

    template = kiln_cache() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(template.with_suffix(".lock")):
            if not template.exists():
                with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
                    from mlflow.tracking import MlflowClient

                    uri = f"sqlite:///{tmp}/store.db"
                    MlflowClient(tracking_uri=uri, registry_uri=uri).search_registered_models(max_results=1)
                    with contextlib.closing(sqlite3.connect(f"{tmp}/store.db")) as con:
                        con.execute("DELETE FROM experiments")
                        con.commit()
                    os.replace(f"{tmp}/store.db", template)
        Path(db).parent.mkdir(parents=True, exist_ok=True)
        partial = Path(f"{db}.kiln-partial")
        shutil.copyfile(template, partial)
        os.replace(partial, db)
    except (OSError, sqlite3.Error):
        return  # MLflow creates and migrates it itself


class Tracker:
    def __init__(self, uri: str | None, experiment: str):
        from mlflow.exceptions import MlflowException

        self.uri = uri or default_uri()
        self.client = open_client(self.uri)
        try:
            exp = self.client.get_experiment_by_name(experiment)
            self.experiment_id = exp.experiment_id if exp else self._create(experiment)
        except MlflowException:  # created by a concurrent run between our get and create
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                raise
            self.experiment_id = exp.experiment_id
        for key, value in EXPERIMENT_KIND.items():
            if exp is not None and exp.tags.get(key) != value:  # an experiment an older kiln made
                with contextlib.suppress(MlflowException):  # another run setting it at the same moment
                    self.client.set_experiment_tag(self.experiment_id, key, value)
        if exp is None or VIEW_TAG not in exp.tags:  # before any run: a link kiln prints opens the view
            self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, view(VIEW_FIGURES))

    def _create(self, experiment: str) -> str:
        """A new experiment; on a local sqlite store its artifacts go beside the .db file, where MLflow
        would put them in ./mlruns of the folder kiln was started in. Other stores keep their own root."""
        where = home.sqlite_artifacts(self.uri)
        # a folder per experiment, named after it (its id is not known before it exists); run ids are unique
        location = str(where / re.sub(r"[^\w.-]+", "_", experiment)) if where else None
        return self.client.create_experiment(experiment, artifact_location=location, tags=EXPERIMENT_KIND)

    def start(self, name: str, tags: Mapping[str, str], parent: str | None = None) -> str:
        tags = {**process_tags(), **tags}  # every run says who owns it, for mark_stale
        if parent:
            tags["mlflow.parentRunId"] = parent
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def log(self, run_id: str, metrics: Mapping[str, float] = {}, params: Mapping[str, Any] = {},
            tags: Mapping[str, str] = {}) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        ms = [Metric(k, float(v), now, 0) for k, v in metrics.items() if _is_number(v)]
        ps = [Param(k, credentials.scrub(str(v))[:6000]) for k, v in params.items()]
        ts = [RunTag(k, credentials.scrub(str(v))) for k, v in tags.items()]
        for i in range(0, max(len(ms), len(ps), len(ts)), 100):  # MLflow caps params per batch at 100
            self.client.log_batch(run_id, metrics=ms[i:i + 100], params=ps[i:i + 100], tags=ts[i:i + 100])

    def log_artifacts(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def show_verdict(self, run_id: str, name: str, verdict: str, passed: bool) -> None:
        """The verdict where the MLflow UI's runs table shows it unasked: in the run's `name` (the
        first column) and as the sortable metric PASSED."""
        self.client.update_run(run_id, name=name)
        self.log(run_id, metrics={PASSED: float(passed)}, tags={VERDICT: verdict})

    def show_figures(self, run_id: str, figures: Mapping[str, float]) -> None:
        """The deciding figures as the parent run's metrics, and each as a column of the experiment's
        view (after those it shows already; of an interval, only the speed-up's): a recipe's own
        quality metric or ratio check shows beside the verdict too."""
        self.log(run_id, metrics=figures)
        shown = view_figures(self.client.get_experiment(self.experiment_id).tags.get(VIEW_TAG)) or list(VIEW_FIGURES)
        ends = {e for f in figures if f != SPEEDUP for e in interval_figures(f)}
        new = [f for f in figures if f not in shown and f not in ends]
        if new:
            self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, view(shown + new))

    def log_data(self, run_id: str, context: str, source: Path, column: str, rows: list[str]) -> None:
        """`rows` read from the local file `source` as one of the run's inputs (MLflow's Dataset
        column), marked with what the run used them for."""
        import mlflow.data
        import pandas as pd
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.exceptions import MlflowException

        # MLflow warns that it registered the local-file source twice ("" and file:) and, in its
        # digest, about a pandas 4 signature: nothing a kiln user can act on
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = mlflow.data.from_pandas(pd.DataFrame({column: rows}), source=str(source), name=Path(source).name)
        # what mlflow.log_input logs, for a run given by id rather than the process's active run
        inputs = [DatasetInput(data._to_mlflow_entity(), [InputTag("mlflow.data.context", context)])]
        try:
            self.client.log_inputs(run_id, inputs)
        except MlflowException:  # another run stored the same data at the same moment (one row per digest): now found
            self.client.log_inputs(run_id, inputs)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)
        if status in UNJUDGED:
            self._show_unjudged(run_id, status)

    def _show_unjudged(self, run_id: str, status: str) -> None:
        """A pipeline run ended KILLED (Ctrl-C, or found dead by `mark_stale`) or FAILED (an error)
        before its verdict: named and tagged so (UNJUDGED), never read as a gate failure."""
        run = self.client.get_run(run_id)
        if run.data.tags.get(KIND) != "pipeline":
            return
        icon, word = UNJUDGED[status]
        folder = Path(run.data.tags.get("kiln.run_dir", run.info.run_name)).name
        self.client.update_run(run_id, name=f"{icon} {word} · {folder}")
        self.log(run_id, tags={VERDICT: word})

    def find_stage(self, key: str) -> str | None:
        """The id of the newest finished run that computed the stage with this key, if any: never a
        reuse, which holds no files. What it holds is checked before use (`stage_evidence.check`)."""
        runs = self.client.search_runs(
            [self.experiment_id],
            f"tags.`{STAGE_KEY}` = '{key}' and tags.`{REUSED}` = 'false' and attributes.status = 'FINISHED'",
            max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def download(self, run_id: str, artifact_path: str, dest: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            local = self.client.download_artifacts(run_id, artifact_path, tmp)
            for p in Path(local).iterdir():
                target = Path(dest) / p.name
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, target)

    def mark_stale(self, tags: Mapping[str, str]) -> list[str]:
        """End runs left RUNNING by a killed process (their pid is gone from their host) as KILLED."""
        filt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        stale = []
        host = socket.gethostname()
        for r in self.client.search_runs([self.experiment_id], f"{filt} and attributes.status = 'RUNNING'"):
            pid = r.data.tags.get("kiln.pid")
            if r.data.tags.get("kiln.host", host) == host and pid and pid.isdigit() and not _alive(int(pid)):
                self.end(r.info.run_id, "KILLED")
                stale.append(r.info.run_id)
        return stale

    def run_url(self, run_id: str) -> str | None:
        if not self.uri.startswith(("http://", "https://")):
            return None
        return f"{redact_uri(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{run_id}"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # drops NaN


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
