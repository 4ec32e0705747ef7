"""MLflow tracking: one parent run per pipeline run, one nested child run per stage.

Uses `MlflowClient` with explicit run ids (no global active-run state), so a resumed run can
re-attach to its parent and stages can be logged in any order. Stage results are also found again
by tag (`kiln.stage_key`), so a fresh machine pointed at the same tracking server reuses the
baseline's results instead of recomputing them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.pipeline.errors import BadInput

STAGE_KEY = "kiln.stage_key"


def default_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def redact_uri(uri: str) -> str:
    """A tracking URI without credentials (`https://user:pass@host` -> `https://***@host`):
    URIs end up in run directories, reports and PR comments."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return uri


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


class Tracker:
    def __init__(self, uri: str | None, experiment: str):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.uri = uri or default_uri()
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        try:
            exp = self.client.get_experiment_by_name(experiment)
            self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        except Exception as e:  # noqa: BLE001 - any backend failure here means a bad URI
            raise BadInput(f"tracking.uri: cannot open MLflow store {self.uri!r}: {e}") from None

    def start(self, name: str, tags: Mapping[str, str], parent: str | None = None) -> str:
        tags = dict(tags)
        if parent:
            tags["mlflow.parentRunId"] = parent
        return self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id

    def log(self, run_id: str, metrics: Mapping[str, float] = {}, params: Mapping[str, Any] = {},
            tags: Mapping[str, str] = {}) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.utils.time import get_current_time_millis

        now = get_current_time_millis()
        ms = [Metric(k, float(v), now, 0) for k, v in metrics.items() if _is_number(v)]
        ps = [Param(k, str(v)[:6000]) for k, v in params.items()]
        ts = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, max(len(ms), len(ps), len(ts)), 100):  # MLflow caps params per batch at 100
            self.client.log_batch(run_id, metrics=ms[i:i + 100], params=ps[i:i + 100], tags=ts[i:i + 100])

    def log_artifacts(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def end(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status)

    def find_stage(self, key: str) -> str | None:
        """The id of a finished run that computed the stage with this key, if any."""
        runs = self.client.search_runs(
            [self.experiment_id], f"tags.`{STAGE_KEY}` = '{key}' and attributes.status = 'FINISHED'",
            max_results=1, order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def download(self, run_id: str, artifact_path: str, dest: Path) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            local = self.client.download_artifacts(run_id, artifact_path, tmp)
            for p in Path(local).iterdir():
                target = Path(dest) / p.name
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, target)

    def mark_stale(self, tags: Mapping[str, str]) -> list[str]:
        """End runs left RUNNING by a killed process (their pid is gone) as KILLED."""
        filt = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        stale = []
        for r in self.client.search_runs([self.experiment_id], f"{filt} and attributes.status = 'RUNNING'"):
            pid = r.data.tags.get("kiln.pid")
            if pid and pid.isdigit() and not _alive(int(pid)):
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
